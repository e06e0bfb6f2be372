"""Health verdicts: from one probe, the data path's failure reports and the live facts to a worker state.

Pure and synchronous (the monitor does the I/O). Hysteresis on both sides: ``failures_to_fail`` bad probes
in a row eject a worker, ``successes_to_ready`` good ones bring it back, so one slow answer never flaps
Envoy's endpoints. Enough data-path failures within a window eject at once and hold the worker out for
``passive_hold_s``, doubled with each such ejection in a row (a worker that fails its requests but answers
its probes would otherwise be back, and failing requests, within a second); then probes decide the way back.
Draining is the drainer's state: health never leaves it, never enters it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from poolgate.kernel.config import HealthSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    reason: str = ""
    """Why the probe failed (``timeout``, ``connection refused``, ``/health 503`` …); empty when ok."""


class Remedy(StrEnum):
    NONE = "none"
    REPLACE = "replace"
    """Failed for too long (a hung or dead engine): kill it and start a fresh one."""
    DRAIN_AND_REPLACE = "drain_and_replace"
    """Serving but unhealthy inside (KV leak): let its requests finish, then start a fresh one."""


@dataclass(frozen=True)
class HealthMemory:
    """What the monitor remembers about one registration of a worker between probes."""

    state: WorkerState
    failures: int = 0
    successes: int = 0
    failed_since: float | None = None
    leak_since: float | None = None
    remedy_sent: bool = False
    passive_ejections: int = 0
    """Ejections on data-path failures in a row (reset once the worker served as long as its last hold)."""
    held_until: float | None = None
    """After such an ejection the worker stays Failed until then, whatever its probes say."""


@dataclass(frozen=True)
class Verdict:
    memory: HealthMemory
    state: WorkerState
    remedy: Remedy = Remedy.NONE
    reason: str = ""


HEALTHY = (WorkerState.READY, WorkerState.BUSY)


def initial_memory(record: WorkerRecord) -> HealthMemory:
    return HealthMemory(state=record.state)


def settled(memory: HealthMemory) -> bool:
    """A Ready worker with nothing under way: no failed probe counted, no leak timed, no data-path hold, no
    remedy sent. Judged again on the same record after a passed probe and no recent data-path failure, it stays
    Ready with the same memory but one more success, whenever that is: stale facts make no worker Busy, and a
    leak needs fresh facts too. So the monitor keeps such a verdict instead of judging it again."""
    return (memory.state is WorkerState.READY and memory.failures == 0 and memory.failed_since is None
            and memory.leak_since is None and not memory.remedy_sent and memory.passive_ejections == 0
            and memory.held_until is None)


def _saturated(record: WorkerRecord, settings: HealthSettings, live_fresh: bool) -> bool:
    return live_fresh and record.waiting > 0 and record.kv_usage >= settings.busy_kv_usage


def _leaking(record: WorkerRecord, settings: HealthSettings, live_fresh: bool) -> bool:
    """KV held with no request to hold it: usage high while nothing runs or waits."""
    return (live_fresh and record.kv_usage >= settings.kv_leak_usage
            and record.running == 0 and record.waiting == 0)


def passive_hold_s(settings: HealthSettings, ejections: int) -> float:
    """How long the ``ejections``-th data-path ejection in a row holds a worker out: doubling, capped."""
    return float(min(settings.passive_hold_s * 2 ** max(0, ejections - 1), settings.passive_hold_max_s))


def judge(memory: HealthMemory, record: WorkerRecord, probe: ProbeResult | None, passive_failures: int,
          settings: HealthSettings, now: float, live_fresh: bool) -> Verdict:
    """The worker's next state and whether it needs a remedy.

    ``probe`` is None for a judgement on the data path's failures alone (the probes' counts stand as they were);
    ``passive_failures`` is the number of data-path failures reported within ``passive_window_s`` and not acted
    on (the monitor counts them; ``controller.recent_failures``);
    ``live_fresh`` says whether the record's KV/queue facts are recent enough to act on.
    """
    if record.state is WorkerState.DRAINING:
        return Verdict(replace(memory, state=WorkerState.DRAINING), WorkerState.DRAINING)
    if probe is None:
        failures, successes, reason = memory.failures, memory.successes, ""
    else:
        failures = 0 if probe.ok else memory.failures + 1
        successes = memory.successes + 1 if probe.ok else 0
        reason = "" if probe.ok else f"probe failed: {probe.reason}"
    healthy_before = memory.state in HEALTHY
    ejections, held_until = memory.passive_ejections, memory.held_until
    if passive_failures >= settings.passive_failures_to_fail:
        failures = max(failures, settings.failures_to_fail)
        successes = 0
        reason = f"{passive_failures} data-path failures reported"
        if healthy_before:
            ejections += 1
            held_until = now + passive_hold_s(settings, ejections)
    if healthy_before:
        healthy = failures < settings.failures_to_fail
    else:
        healthy = successes >= settings.successes_to_ready and (held_until is None or now >= held_until)
    if not healthy and memory.state is WorkerState.STARTING:
        # Registered before it serves: it stays Starting (UNHEALTHY in Envoy) until enough good probes.
        return Verdict(replace(memory, failures=failures, successes=successes), WorkerState.STARTING)
    if not healthy:
        failed_since = memory.failed_since if memory.failed_since is not None else now
        remedy = Remedy.NONE
        remedy_sent = memory.remedy_sent
        if now - failed_since >= settings.replace_failed_after_s and not memory.remedy_sent:
            remedy, remedy_sent = Remedy.REPLACE, True
            reason = f"failed for {now - failed_since:.1f} s ({reason or 'probes failing'})"
        elif healthy_before:
            reason = reason or "probes failing"
        elif held_until is not None and now < held_until and successes >= settings.successes_to_ready:
            reason = f"held out {held_until - now:.1f} s more after data-path failures"
        next_memory = HealthMemory(WorkerState.FAILED, failures, successes, failed_since, None, remedy_sent,
                                   ejections, held_until)
        return Verdict(next_memory, WorkerState.FAILED, remedy, reason)
    state = WorkerState.BUSY if _saturated(record, settings, live_fresh) else WorkerState.READY
    leak_since: float | None = None
    remedy = Remedy.NONE
    remedy_sent = False
    if _leaking(record, settings, live_fresh):
        leak_since = memory.leak_since if memory.leak_since is not None else now
        remedy_sent = memory.remedy_sent
        if now - leak_since >= settings.kv_leak_after_s and not memory.remedy_sent:
            remedy, remedy_sent = Remedy.DRAIN_AND_REPLACE, True
            reason = (f"KV usage {record.kv_usage:.0%} with nothing running for {now - leak_since:.1f} s "
                      "(KV leak)")
    if not healthy_before:
        reason = reason or f"{successes} good probes in a row"
    if ejections and held_until is not None and now - held_until >= passive_hold_s(settings, ejections):
        ejections, held_until = 0, None  # it served as long as it was last held: the next ejection starts over
    next_memory = HealthMemory(state, failures, successes, None, leak_since, remedy_sent, ejections, held_until)
    return Verdict(next_memory, state, remedy, reason)
