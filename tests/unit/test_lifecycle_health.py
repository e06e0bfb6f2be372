"""Health verdicts: thresholds both ways, passive bursts, Busy, hung → replace, KV leak → drain and replace."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.health import HealthMemory, ProbeResult, Remedy, Verdict, initial_memory, judge, settled
from poolgate.kernel.config import HealthSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState

SETTINGS = HealthSettings(failures_to_fail=3, successes_to_ready=2, passive_failures_to_fail=3,
                          passive_hold_s=2.0, passive_hold_max_s=6.0, replace_failed_after_s=5.0,
                          kv_leak_usage=0.9, kv_leak_after_s=4.0, busy_kv_usage=0.95)
OK = ProbeResult(ok=True, latency_s=0.01)
BAD = ProbeResult(ok=False, latency_s=1.0, reason="no answer within 1 s")


def record(state: WorkerState = WorkerState.READY, **live: float) -> WorkerRecord:
    return WorkerRecord(id="w", pool="p", model="m", host="127.0.0.1", port=9000, state=state, **live)  # type: ignore[arg-type]


def run(probes: list[ProbeResult | None], rec: WorkerRecord | None = None, passive: list[int] | None = None,
        step_s: float = 1.0, fresh: bool = True) -> list[Verdict]:
    rec = rec or record()
    memory = initial_memory(rec)
    verdicts = []
    for index, probe in enumerate(probes):
        verdict = judge(memory, rec, probe, (passive or [0] * len(probes))[index], SETTINGS, index * step_s, fresh)
        memory = verdict.memory
        rec = record(verdict.state, kv_usage=rec.kv_usage, running=rec.running, waiting=rec.waiting)
        verdicts.append(verdict)
    return verdicts


def test_one_or_two_bad_probes_do_not_eject() -> None:
    states = [v.state for v in run([BAD, BAD, OK, BAD, BAD, OK])]
    assert states == [WorkerState.READY] * 6


def test_failures_to_fail_then_successes_to_ready() -> None:
    verdicts = run([BAD, BAD, BAD, OK, OK, OK])
    assert [v.state for v in verdicts] == [WorkerState.READY, WorkerState.READY, WorkerState.FAILED,
                                           WorkerState.FAILED, WorkerState.READY, WorkerState.READY]
    assert "probe failed" in verdicts[2].reason


def test_a_burst_of_passive_failures_ejects_at_once_and_probes_bring_it_back() -> None:
    verdicts = run([OK, OK, OK, OK], passive=[0, 3, 0, 0])
    assert [v.state for v in verdicts] == [WorkerState.READY, WorkerState.FAILED, WorkerState.FAILED,
                                           WorkerState.READY]
    assert "data-path" in verdicts[1].reason


def test_passive_failures_alone_eject_without_a_probe_and_probes_bring_it_back() -> None:
    verdicts = run([OK, None, OK, OK], passive=[0, 3, 0, 0])
    assert [v.state for v in verdicts] == [WorkerState.READY, WorkerState.FAILED, WorkerState.FAILED,
                                           WorkerState.READY]
    assert "data-path" in verdicts[1].reason and verdicts[1].memory.successes == 0


def test_a_judgement_without_a_probe_leaves_the_probe_counts_as_they_were() -> None:
    verdicts = run([BAD, BAD, None, BAD], passive=[0, 0, 1, 0])
    assert [v.memory.failures for v in verdicts] == [1, 2, 2, 3]
    assert [v.state for v in verdicts][-1] is WorkerState.FAILED


def test_a_worker_ejected_on_data_path_failures_is_held_out_though_its_probes_pass() -> None:
    verdicts = run([OK, None, OK, OK, OK, OK], passive=[0, 3, 0, 0, 0, 0], step_s=0.5)  # held 0.5 → 2.5 s
    assert [v.state for v in verdicts] == [WorkerState.READY, WorkerState.FAILED, WorkerState.FAILED,
                                           WorkerState.FAILED, WorkerState.FAILED, WorkerState.READY]
    assert "held out" in verdicts[3].reason


def test_each_data_path_ejection_in_a_row_holds_twice_as_long_up_to_the_cap() -> None:
    # ejected at 1 s (held 2 s), back at 3 s, ejected again at 4 s (held 4 s), back at 8 s, again at 9 s (6 s cap)
    passive = [0, 3, 0, 0, 3, 0, 0, 0, 0, 3]
    verdicts = run([OK, None, OK, OK, None, OK, OK, OK, OK, None], passive=passive)
    assert [v.memory.passive_ejections for v in verdicts] == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert [v.state for v in verdicts][3] is WorkerState.READY and [v.state for v in verdicts][8] is WorkerState.READY
    assert [v.memory.held_until for v in verdicts if v.memory.held_until is not None][-1] == 9.0 + 6.0


def test_a_worker_that_served_as_long_as_it_was_held_starts_over() -> None:
    verdicts = run([OK, None, OK, OK, OK, OK, OK, None], passive=[0, 3, 0, 0, 0, 0, 0, 3])
    # held 1 → 3 s, back at 3 s, served 2 s (its hold) by 5 s: the ejection at 7 s is a first one again
    assert [v.memory.passive_ejections for v in verdicts] == [0, 1, 1, 1, 1, 0, 0, 1]
    assert verdicts[-1].memory.held_until == 7.0 + 2.0


def test_fewer_passive_failures_than_the_threshold_are_tolerated() -> None:
    assert [v.state for v in run([OK, OK], passive=[2, 2])] == [WorkerState.READY] * 2


def test_hung_worker_is_replaced_once_after_staying_failed() -> None:
    verdicts = run([BAD] * 12)
    remedies = [(i, v.remedy) for i, v in enumerate(verdicts) if v.remedy is not Remedy.NONE]
    # Failed at probe 2 (t = 2 s), replaced 5 s later, and only once.
    assert remedies == [(7, Remedy.REPLACE)]


@pytest.mark.parametrize(("kv", "waiting", "fresh", "state"), [
    (0.97, 3, True, WorkerState.BUSY),
    (0.97, 0, True, WorkerState.READY),
    (0.5, 9, True, WorkerState.READY),
    (0.97, 3, False, WorkerState.READY),  # stale facts never make a worker Busy
])
def test_busy_when_saturated(kv: float, waiting: int, fresh: bool, state: WorkerState) -> None:
    verdict = run([OK], record(kv_usage=kv, waiting=waiting, running=5), fresh=fresh)[0]
    assert verdict.state is state


def test_kv_leak_is_drained_and_replaced_once() -> None:
    verdicts = run([OK] * 8, record(kv_usage=0.93, running=0, waiting=0))
    remedies = [(i, v.remedy) for i, v in enumerate(verdicts) if v.remedy is not Remedy.NONE]
    assert remedies == [(4, Remedy.DRAIN_AND_REPLACE)]
    assert "KV leak" in verdicts[4].reason


def test_high_kv_with_work_running_is_no_leak() -> None:
    assert all(v.remedy is Remedy.NONE for v in run([OK] * 8, record(kv_usage=0.93, running=4)))


def test_draining_is_left_alone_even_when_probes_fail() -> None:
    rec = record(WorkerState.DRAINING)
    verdict = judge(HealthMemory(WorkerState.READY), rec, BAD, 10, SETTINGS, 0.0, True)
    assert verdict.state is WorkerState.DRAINING and verdict.remedy is Remedy.NONE


def test_a_worker_registered_starting_needs_successes() -> None:
    verdicts = run([OK, OK], record(WorkerState.STARTING))
    assert [v.state for v in verdicts] == [WorkerState.STARTING, WorkerState.READY]


@pytest.mark.parametrize(("rec", "settles_when_fresh"), [
    (record(), True),
    (record(kv_usage=0.97, waiting=3, running=5), False),  # Busy while its facts are fresh
    (record(kv_usage=0.93, running=0, waiting=0), False),  # a leak timed while its facts are fresh
])
def test_a_settled_verdict_holds_for_every_passed_probe_of_the_same_record(rec: WorkerRecord,
                                                                           settles_when_fresh: bool) -> None:
    """What lets the monitor keep a settled verdict instead of judging again: the same record, a passed probe and no
    data-path failure give the same state and memory (but the count of successes), fresh facts or stale."""
    for fresh in (True, False):
        first = judge(HealthMemory(WorkerState.READY), rec, OK, 0, SETTINGS, 0.0, fresh)
        assert settled(first.memory) is (settles_when_fresh or not fresh)
        if not settled(first.memory):
            continue
        for fresh_later in ((True, False) if fresh else (False,)):  # facts only go stale while the record stays
            later = judge(first.memory, rec, OK, 0, SETTINGS, 100.0, fresh_later)
            assert (later.state, later.remedy) == (WorkerState.READY, Remedy.NONE)
            assert replace(later.memory, successes=first.memory.successes) == first.memory


def test_a_worker_with_failures_counted_or_held_out_is_not_settled() -> None:
    assert not settled(run([OK, BAD])[-1].memory)
    assert not settled(run([OK, None], passive=[0, 3])[-1].memory)
    assert settled(run([OK, BAD, OK])[-1].memory)
