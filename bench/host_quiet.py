"""How quiet the host was while a benchmark ran: every report says so, and says when it was not.

A latency figure taken while something else on the host used a core is a figure about that something
else. So each benchmark measures, beside its own figures:

- the 1-minute load average just before the run (nothing of the run started yet) and, sampled about
  once a second, during it (mean and max; the run's own processes raise it, so it reads with the
  figures, not as a verdict);
- the CPU used by *other* processes: every process in ``/proc`` except this benchmark's own tree
  (this process and every descendant found by walking ``ppid``: simulated workers, Envoy, extproc,
  peers are part of the run). A process once seen in the tree stays in it after its parent dies.

The report is ``noisy`` when other processes used more than ``NOISY_OTHERS_CORES`` (half a core) on
average, or the load average before the run was at least ``NOISY_LOAD_BEFORE`` (0.5): the 1-minute
average decays slowly, so a run started right after another heavy job is marked noisy even if that job
just ended; wait for the load to settle, then start.

Others' CPU over one interval, from two snapshots (ticks = utime + stime + cutime + cstime):

    others = Σ over other processes alive at the end of (ticks_end − ticks_start, or ticks_end if new)
             − Σ over processes that vanished in between of their last-seen ticks,
               charged to their last-seen parent (which reaped them and whose cutime grew by their
               whole life),

each alive process's share floored at its own utime + stime delta (a parent that ignores SIGCHLD
reaps without adding to cutime). Counting reaped children catches short-lived jobs (a compiler run,
a test run) that start and end between two samples. What it cannot see: a process that vanished
while its parent is gone or outside this PID namespace (its last interval is lost), and an orphan of
this benchmark reaped by init, whose last interval counts as someone else's.

``measure()`` is the entry point: a context manager around a run, yielding the ``Sampler`` whose
``summary()`` (while running or after) is the frozen ``HostQuiet`` that ``attach`` puts into a report
as ``"host"``. I/O lives in ``read_snapshot`` and the sampler's thread; ``QuietRecord`` (the
arithmetic and the verdict) takes snapshots as values and is tested over hand-made ones.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOISY_OTHERS_CORES = 0.5
NOISY_LOAD_BEFORE = 0.5
SAMPLE_INTERVAL_S = 1.0
TOP_OTHERS = 3
COMMAND_CHARS = 80
PEAK_MIN_SPAN_S = 0.5
"""Shortest interval that counts towards the busiest one: CPU time comes in 10 ms ticks, so a reading taken
just after the previous one (a report written mid-run) would turn one tick into a core."""

ProcessKey = tuple[int, int]
"""(pid, start time in ticks): a pid reused by a new process is a new key."""


@dataclass(frozen=True, slots=True)
class ProcessSample:
    pid: int
    start_ticks: int
    ppid: int
    command: str
    own_ticks: int
    """utime + stime: CPU this process (all its threads) used so far."""
    reaped_ticks: int
    """cutime + cstime: CPU of children it has waited for (and theirs)."""

    @property
    def key(self) -> ProcessKey:
        return (self.pid, self.start_ticks)

    @property
    def total_ticks(self) -> int:
        return self.own_ticks + self.reaped_ticks


@dataclass(frozen=True, slots=True)
class HostSnapshot:
    at_s: float
    """Monotonic time of the reading."""
    load_1m: float
    processes: Mapping[int, ProcessSample]
    """By pid."""


@dataclass(frozen=True, slots=True)
class OtherProcess:
    pid: int
    command: str
    cores: float
    """Mean cores over the measured span."""


@dataclass(frozen=True, slots=True)
class HostQuiet:
    """What a report says about the host during its run."""

    load_before: float
    load_mean: float
    load_max: float
    others_cores_mean: float
    others_cores_max: float
    """The busiest sampling interval (of at least ``PEAK_MIN_SPAN_S``)."""
    top_others: tuple[OtherProcess, ...]
    span_s: float
    samples: int
    host_cores: int
    noisy: bool

    def as_dict(self) -> dict[str, Any]:
        return {"measured": True, "noisy": self.noisy, "load_before": round(self.load_before, 2),
                "load_mean": round(self.load_mean, 2), "load_max": round(self.load_max, 2),
                "others_cores_mean": round(self.others_cores_mean, 3),
                "others_cores_max": round(self.others_cores_max, 3),
                "top_others": [{"pid": p.pid, "command": p.command, "cores": round(p.cores, 3)}
                               for p in self.top_others],
                "span_s": round(self.span_s, 1), "samples": self.samples, "host_cores": self.host_cores,
                "thresholds": {"others_cores": NOISY_OTHERS_CORES, "load_before": NOISY_LOAD_BEFORE}}


def is_noisy(load_before: float, others_cores_mean: float) -> bool:
    """Noisy when others used more than half a core on average, or the host was busy before the run."""
    return others_cores_mean > NOISY_OTHERS_CORES or load_before >= NOISY_LOAD_BEFORE


def own_tree(snapshot: HostSnapshot, root_pid: int,
             known: frozenset[ProcessKey] = frozenset()) -> frozenset[ProcessKey]:
    """Keys of ``root_pid`` and its descendants (by ``ppid``), plus ``known`` ones still alive and theirs."""
    processes = snapshot.processes
    roots = {pid for pid, sample in processes.items() if pid == root_pid or sample.key in known}
    children: dict[int, list[int]] = {}
    for pid, sample in processes.items():
        children.setdefault(sample.ppid, []).append(pid)
    found: set[ProcessKey] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        key = processes[pid].key
        if key in found:
            continue
        found.add(key)
        stack.extend(children.get(pid, ()))
    return frozenset(found)


def others_ticks(before: HostSnapshot, after: HostSnapshot, own_before: frozenset[ProcessKey],
                 own_after: frozenset[ProcessKey]) -> dict[ProcessKey, int]:
    """CPU ticks each other process used between two snapshots, reaped children included (module docstring).

    A vanished process's last-seen ticks are taken off its last-seen parent's, when that parent is alive at
    ``after`` (it reaped the child, and its cutime grew by the child's whole life). Processes of the
    benchmark's own tree are left out, at either end.
    """
    alive_after = {sample.key: sample for sample in after.processes.values()}
    seen_before = {sample.key: sample for sample in before.processes.values()}
    reaped_before: dict[ProcessKey, int] = {}
    for key, sample in seen_before.items():
        if key in alive_after:
            continue
        parent = before.processes.get(sample.ppid)
        if parent is not None and parent.key in alive_after:
            reaped_before[parent.key] = reaped_before.get(parent.key, 0) + sample.total_ticks
    used: dict[ProcessKey, int] = {}
    for key, sample in alive_after.items():
        if key in own_after or key in own_before:
            continue
        earlier = seen_before.get(key)
        own = sample.own_ticks - (earlier.own_ticks if earlier else 0)
        reaped = sample.reaped_ticks - (earlier.reaped_ticks if earlier else 0) - reaped_before.get(key, 0)
        ticks = max(0, own) + max(0, reaped)
        if ticks:
            used[key] = ticks
    return used


@dataclass
class QuietRecord:
    """Snapshots folded into running totals; ``summary()`` at any point gives the verdict so far."""

    root_pid: int
    ticks_per_s: float
    host_cores: int
    first: HostSnapshot | None = None
    last: HostSnapshot | None = None
    own: frozenset[ProcessKey] = frozenset()
    loads: list[float] = field(default_factory=list)
    interval_cores: list[float] = field(default_factory=list)
    ticks_by_process: dict[ProcessKey, int] = field(default_factory=dict)
    commands: dict[ProcessKey, str] = field(default_factory=dict)

    def add(self, snapshot: HostSnapshot) -> dict[ProcessKey, int]:
        """Fold one snapshot in; returns the other processes' ticks since the previous one."""
        own = own_tree(snapshot, self.root_pid, self.own)
        used: dict[ProcessKey, int] = {}
        if self.last is None:
            self.first = snapshot
        else:
            used = others_ticks(self.last, snapshot, self.own, own)
            span = snapshot.at_s - self.last.at_s
            if span >= PEAK_MIN_SPAN_S:
                self.interval_cores.append(sum(used.values()) / self.ticks_per_s / span)
            self.loads.append(snapshot.load_1m)
            for key, ticks in used.items():
                self.ticks_by_process[key] = self.ticks_by_process.get(key, 0) + ticks
                self.commands.setdefault(key, snapshot.processes[key[0]].command)
        self.own = own
        self.last = snapshot
        return used

    def name(self, key: ProcessKey, command: str) -> None:
        """A better name (the command line) for a process than the kernel's 15-character one."""
        self.commands[key] = command

    def summary(self) -> HostQuiet:
        load_before = self.first.load_1m if self.first else 0.0
        span = (self.last.at_s - self.first.at_s) if self.first and self.last else 0.0
        others_total = sum(self.ticks_by_process.values()) / self.ticks_per_s
        others_mean = others_total / span if span > 0 else 0.0
        top = sorted(self.ticks_by_process.items(), key=lambda item: item[1], reverse=True)[:TOP_OTHERS]
        return HostQuiet(
            load_before=load_before,
            load_mean=sum(self.loads) / len(self.loads) if self.loads else load_before,
            load_max=max(self.loads, default=load_before),
            others_cores_mean=others_mean,
            others_cores_max=max(self.interval_cores, default=0.0),
            top_others=tuple(OtherProcess(key[0], self.commands.get(key, "?"), ticks / self.ticks_per_s / span)
                             for key, ticks in top if span > 0),
            span_s=span, samples=len(self.loads) + (1 if self.first else 0), host_cores=self.host_cores,
            noisy=is_noisy(load_before, others_mean))


def parse_stat(pid: int, text: str) -> ProcessSample:
    """One ``/proc/[pid]/stat`` line; the command sits in parentheses and may hold spaces and parentheses."""
    command = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 of proc(5): state; ppid is 4, utime..cstime 14-17, starttime 22.
    return ProcessSample(pid=pid, start_ticks=int(fields[19]), ppid=int(fields[1]), command=command,
                         own_ticks=int(fields[11]) + int(fields[12]), reaped_ticks=int(fields[13]) + int(fields[14]))


def read_snapshot(proc: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> HostSnapshot:
    """The load average and every process's CPU counters; processes that vanish while being read are skipped."""
    at = clock()
    load = float(_read(os.path.join(proc, "loadavg")).split()[0])
    processes: dict[int, ProcessSample] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            text = _read(os.path.join(entry.path, "stat")).decode(errors="replace")
        except OSError:
            continue
        pid = int(entry.name)
        processes[pid] = parse_stat(pid, text)
    return HostSnapshot(at_s=at, load_1m=load, processes=processes)


def _read(path: str) -> bytes:
    """One small /proc file with a bare read: a third of ``Path.read_text``'s CPU, which the sampler's thread
    takes from the benchmark's own process once a second."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        return os.read(descriptor, 4096)
    finally:
        os.close(descriptor)


def command_line(pid: int, proc: Path = Path("/proc")) -> str | None:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
    return text[:COMMAND_CHARS] or None


class Sampler:
    """``QuietRecord`` fed from ``/proc`` by a daemon thread about once a second.

    A thread rather than an asyncio task: benchmarks are sync and async alike, and a busy event loop
    must not delay the samples. One reading costs about 1.5 ms of CPU per hundred processes, taken
    from the benchmark's own process (and its GIL) once a second.
    """

    def __init__(self, *, interval_s: float = SAMPLE_INTERVAL_S, root_pid: int | None = None,
                 read: Callable[[], HostSnapshot] = read_snapshot,
                 describe: Callable[[int], str | None] = command_line) -> None:
        self.interval_s = interval_s
        self.read = read
        self.describe = describe
        self.record = QuietRecord(root_pid=root_pid if root_pid is not None else os.getpid(),
                                  ticks_per_s=float(os.sysconf("SC_CLK_TCK")), host_cores=os.cpu_count() or 1)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.stopped: HostQuiet | None = None
        self.named: set[ProcessKey] = set()

    def start(self) -> Sampler:
        """Take the before-reading now (call it before the run starts anything), then sample in the background."""
        self.sample()
        self.thread = threading.Thread(target=self._loop, name="host-quiet", daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        with self.lock:  # read inside the lock: two readers must fold their snapshots in time order
            used = self.record.add(self.read())
            unnamed = [key for key in used if key not in self.named]
        for key in unnamed:
            command = self.describe(key[0])
            with self.lock:
                self.named.add(key)
                if command:
                    self.record.name(key, command)

    def summary(self) -> HostQuiet:
        """The verdict so far (a last reading taken now), or the final one once stopped."""
        if self.stopped is not None:
            return self.stopped
        self.sample()
        with self.lock:
            return self.record.summary()

    def stop(self) -> HostQuiet:
        if self.stopped is None:
            self.stopping.set()
            if self.thread is not None:
                self.thread.join()
            self.stopped = self.summary()
        return self.stopped

    def _loop(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.sample()


@contextlib.contextmanager
def measure(*, interval_s: float = SAMPLE_INTERVAL_S) -> Iterator[Sampler]:
    """Measure the host around a run: ``with measure() as quiet: ...; write_report(..., host=quiet.summary())``."""
    sampler = Sampler(interval_s=interval_s).start()
    try:
        yield sampler
    finally:
        sampler.stop()


def attach(report: Any, host: HostQuiet | None) -> Any:
    """The one place a report gets its ``"host"`` section.

    Given a measurement, it is set; without one, a ``"host"`` the report already holds stays, and a report
    that has none says it was not measured (with the load averages at the time of writing).
    """
    if not isinstance(report, Mapping):
        return report
    if host is not None:
        return {**report, "host": host.as_dict()}
    if "host" in report:
        return report
    return {**report, "host": {"measured": False, "noisy": None,
                               "load_at_write": [round(x, 2) for x in os.getloadavg()]}}


def describe(host: Mapping[str, Any] | None) -> str:
    """One line for consoles and markdown: quiet, ``NOISY``, or not measured."""
    if not host or not host.get("measured"):
        return "host quiet: not measured"
    others = ", ".join(f"{_short(p['command'])} {p['cores']:.2f}" for p in host["top_others"] if p["cores"] >= 0.01)
    text = (f"load {host['load_before']:.2f} before, {host['load_mean']:.2f} mean during (max "
            f"{host['load_max']:.2f}); others {host['others_cores_mean']:.2f} cores (max "
            f"{host['others_cores_max']:.2f})" + (f": {others}" if others else ""))
    return ("NOISY: " if host["noisy"] else "host quiet: ") + text


def _short(command: str) -> str:
    """``/usr/bin/python3 -m pytest tests`` as ``python3 -m pytest tests``, cut at 40 characters."""
    program, _, arguments = command.partition(" ")
    text = program.rsplit("/", 1)[-1] + (" " + arguments if arguments else "")
    return text if len(text) <= 40 else text[:39] + "…"
