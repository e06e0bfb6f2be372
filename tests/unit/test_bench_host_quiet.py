"""The host-quiet arithmetic and verdict over hand-made /proc snapshots (no sleeping, no real /proc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import host_quiet
from bench.host_quiet import HostSnapshot, ProcessSample, QuietRecord, Sampler

HZ = 100.0
ME = 1000


def proc(pid: int, ppid: int, own: int, reaped: int = 0, command: str = "", start: int = 0) -> ProcessSample:
    return ProcessSample(pid=pid, start_ticks=start or pid, ppid=ppid, command=command or f"p{pid}",
                         own_ticks=own, reaped_ticks=reaped)


def snap(at_s: float, load: float, *processes: ProcessSample) -> HostSnapshot:
    return HostSnapshot(at_s=at_s, load_1m=load, processes={p.pid: p for p in processes})


def record() -> QuietRecord:
    return QuietRecord(root_pid=ME, ticks_per_s=HZ, host_cores=2)


@pytest.mark.parametrize(("load_before", "others", "noisy"), [
    (0.1, 0.0, False), (0.49, 0.5, False), (0.1, 0.51, True), (0.5, 0.0, True), (2.0, 0.1, True),
])
def test_noisy_past_half_a_core_or_a_busy_start(load_before: float, others: float, noisy: bool) -> None:
    assert host_quiet.is_noisy(load_before, others) is noisy


def test_own_tree_follows_ppid_and_keeps_orphans_once_seen() -> None:
    first = snap(0, 0, proc(1, 0, 0), proc(ME, 1, 0), proc(1001, ME, 0), proc(1002, 1001, 0), proc(2000, 1, 0))
    own = host_quiet.own_tree(first, ME)
    assert own == {(ME, ME), (1001, 1001), (1002, 1002)}
    # 1001 died; its child 1002 was reparented to init and started 1003: still the benchmark's
    later = snap(1, 0, proc(1, 0, 0), proc(ME, 1, 0), proc(1002, 1, 0), proc(1003, 1002, 0), proc(2000, 1, 0))
    assert host_quiet.own_tree(later, ME, own) == {(ME, ME), (1002, 1002), (1003, 1003)}


def test_others_cpu_excludes_the_benchmark_tree_and_counts_new_processes_whole() -> None:
    rec = record()
    rec.add(snap(10.0, 0.2, proc(1, 0, 5), proc(ME, 1, 100), proc(1001, ME, 50), proc(2000, 1, 300)))
    used = rec.add(snap(12.0, 0.4, proc(1, 0, 5), proc(ME, 1, 300), proc(1001, ME, 250), proc(2000, 1, 340),
                        proc(2001, 1, 60)))
    assert used == {(2000, 2000): 40, (2001, 2001): 60}
    summary = rec.summary()
    assert summary.others_cores_mean == pytest.approx(100 / HZ / 2.0)
    assert summary.others_cores_max == pytest.approx(0.5)
    assert [(p.pid, p.command, p.cores) for p in summary.top_others] == [(2001, "p2001", 0.3), (2000, "p2000", 0.2)]
    assert (summary.load_before, summary.load_mean, summary.load_max) == (0.2, 0.4, 0.4)
    assert summary.noisy is False and summary.samples == 2


def test_a_reading_right_after_another_does_not_make_a_peak_of_one_tick() -> None:
    rec = record()
    rec.add(snap(0.0, 0.0, proc(ME, 1, 0), proc(7000, 1, 0)))
    rec.add(snap(1.0, 0.0, proc(ME, 1, 0), proc(7000, 1, 10)))
    rec.add(snap(1.01, 0.0, proc(ME, 1, 0), proc(7000, 1, 11)))
    summary = rec.summary()
    assert summary.others_cores_max == pytest.approx(0.1)
    assert summary.others_cores_mean == pytest.approx(0.11 / 1.01)


def test_a_short_lived_child_counts_through_its_parents_reaped_time_once() -> None:
    rec = record()
    rec.add(snap(0.0, 0.0, proc(ME, 1, 0), proc(3000, 1, 10), proc(3001, 3000, 30)))
    # 3001 ran 30 more ticks and was reaped (its 60 in total join 3000's cutime); 3002 lived and died
    # between the samples: 25 ticks, seen only through the parent's cutime
    used = rec.add(snap(1.0, 0.0, proc(ME, 1, 0), proc(3000, 1, 12, reaped=60 + 25)))
    assert used == {(3000, 3000): 2 + 30 + 25}


def test_a_parent_that_reaps_without_cutime_is_never_charged_less_than_its_own_cpu() -> None:
    rec = record()
    rec.add(snap(0.0, 0.0, proc(ME, 1, 0), proc(3000, 1, 10), proc(3001, 3000, 500)))
    used = rec.add(snap(1.0, 0.0, proc(ME, 1, 0), proc(3000, 1, 14)))  # SIGCHLD ignored: cutime stays 0
    assert used == {(3000, 3000): 4}


def test_a_reused_pid_is_a_new_process() -> None:
    rec = record()
    rec.add(snap(0.0, 0.0, proc(ME, 1, 0), proc(4000, 1, 900, start=7)))
    used = rec.add(snap(1.0, 0.0, proc(ME, 1, 0), proc(4000, 1, 20, start=99)))
    assert used == {(4000, 99): 20}


def test_half_a_core_of_others_makes_the_report_noisy() -> None:
    rec = record()
    rec.add(snap(0.0, 0.1, proc(ME, 1, 0), proc(5000, 1, 0)))
    rec.add(snap(1.0, 0.3, proc(ME, 1, 0), proc(5000, 1, 40)))
    rec.add(snap(2.0, 0.5, proc(ME, 1, 0), proc(5000, 1, 110)))
    summary = rec.summary()
    assert summary.others_cores_mean == pytest.approx(0.55) and summary.others_cores_max == pytest.approx(0.7)
    assert summary.noisy is True
    assert host_quiet.describe(summary.as_dict()).startswith("NOISY: load 0.10 before, 0.40 mean during")


def test_parse_stat_reads_a_command_with_spaces_and_parentheses() -> None:
    fields = ["S", "42"] + ["0"] * 9 + ["11", "22", "33", "44"] + ["0"] * 4 + ["777"] + ["0"] * 10
    sample = host_quiet.parse_stat(4242, "4242 (my (odd) name) " + " ".join(fields))
    assert sample == ProcessSample(pid=4242, start_ticks=777, ppid=42, command="my (odd) name", own_ticks=33,
                                   reaped_ticks=77)


def test_read_snapshot_over_a_fake_proc(tmp_path: Path) -> None:
    (tmp_path / "loadavg").write_text("0.25 0.20 0.10 1/99 123\n")
    for pid, ppid, utime in ((1, 0, 3), (ME, 1, 8)):
        (tmp_path / str(pid)).mkdir()
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), "1", "0", "0"] + ["0"] * 4 + ["5"] + ["0"] * 10
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (proc{pid}) " + " ".join(rest) + "\n")
    (tmp_path / "self").mkdir()
    snapshot = host_quiet.read_snapshot(tmp_path, clock=lambda: 7.0)
    assert snapshot.at_s == 7.0 and snapshot.load_1m == 0.25
    assert {pid: (p.ppid, p.own_ticks, p.command) for pid, p in snapshot.processes.items()} == {
        1: (0, 4, "proc1"), ME: (1, 9, f"proc{ME}")}


def test_sampler_names_busy_others_by_their_command_line() -> None:
    readings = iter([snap(0.0, 0.05, proc(ME, 1, 0), proc(6000, 1, 0, command="python3")),
                     snap(4.0, 0.05, proc(ME, 1, 0), proc(6000, 1, 40, command="python3"))])
    sampler = Sampler(root_pid=ME, read=lambda: next(readings),
                      describe=lambda pid: "/usr/bin/python3 -m pytest tests/unit")
    sampler.sample()
    sampler.sample()
    summary = sampler.record.summary()
    assert summary.top_others[0].command == "/usr/bin/python3 -m pytest tests/unit"
    line = host_quiet.describe(summary.as_dict())
    assert line == ("host quiet: load 0.05 before, 0.05 mean during (max 0.05); others "
                    f"{40 / sampler.record.ticks_per_s / 4:.2f} cores (max "
                    f"{40 / sampler.record.ticks_per_s / 4:.2f}): python3 -m pytest tests/unit "
                    f"{40 / sampler.record.ticks_per_s / 4:.2f}")


def test_attach_is_the_one_place_a_report_gets_its_host_section() -> None:
    rec = record()
    rec.add(snap(0.0, 0.1, proc(ME, 1, 0)))
    rec.add(snap(1.0, 0.1, proc(ME, 1, 0)))
    measured = host_quiet.attach({"rows": []}, rec.summary())
    assert measured["host"]["measured"] is True and measured["host"]["noisy"] is False
    assert host_quiet.attach(measured, None) is measured
    unmeasured = host_quiet.attach({"rows": []}, None)["host"]
    assert unmeasured["measured"] is False and unmeasured["noisy"] is None
    assert host_quiet.describe(unmeasured) == "host quiet: not measured"
