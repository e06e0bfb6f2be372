"""The health monitor: probes every registered worker each interval and writes the verdicts to Redis.

Keeps its own copy of the fleet (``FleetView``: only changed records are re-read), reads the data path's
failure counters, probes the workers spread over the first half of the interval with at most
``PROBE_CONCURRENCY`` in flight (a large fleet is not probed in one burst; one hung worker holds one slot
for at most the probe timeout; a serving worker's failed probe is repeated at once to confirm it, so a dead
worker leaves within the round that finds it), judges each (``controller.health``), writes the states that differ from
what Redis holds in one batch with one announcement (so a mass failure costs readers one read, not one per
worker), and hands remedies to the instance controller. Only the leader acts; a follower keeps quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from controller.health import HEALTHY, HealthMemory, ProbeResult, Remedy, Verdict, initial_memory, judge
from controller.periodic import every
from poolgate.kernel.config import HealthSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import OutageLog
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.health")

PROBE_CONCURRENCY = 256
"""Probes in flight at once; more wait for a slot."""
PROBE_SPREAD = 0.5
"""Share of the probe interval over which a round's probes start (the rest is room for slow answers)."""
CONFIRM_SHARE = 0.5
"""A failed probe of a serving worker is repeated after this share of the probe interval, until it passes or
the failures in a row reach ``failures_to_fail`` (each repeat must fail too: one slow answer still never
ejects a worker)."""
PROBES_PER_S = 4000.0
"""A round starts at most this many probes per second: past ``PROBES_PER_S × PROBE_SPREAD × interval``
workers a round takes longer than the interval, so a large fleet costs the controller a bounded probe
rate (at 10,000 workers and 0.5 s: a round every 2.5 s, a dead worker confirmed Failed within the round
that finds it, ``CONFIRM_SHARE``)."""


class Prober(Protocol):
    async def probe(self, record: WorkerRecord) -> ProbeResult: ...


class Remediator(Protocol):
    """Acts on a remedy; the instance controller decides whether it owns the worker."""

    async def remedy(self, worker_id: str, remedy: Remedy, reason: str) -> None: ...


@dataclass
class MonitorStats:
    rounds: int = 0
    probes: int = 0
    probe_failures: int = 0
    transitions: dict[str, int] = field(default_factory=dict)
    """``"Ready->Failed"`` → count."""
    batches: int = 0
    """State writes (each carries every change of one round)."""
    remedies: dict[str, int] = field(default_factory=dict)


@dataclass
class _Seen:
    registration: tuple[str, float]
    memory: HealthMemory
    passive_total: int


class HealthMonitor:
    """Judges every worker each round. ``stale_after_s`` is extproc's bound on the age of agent facts
    (``extproc.stale_after_s``): older facts do not count as fresh evidence."""

    def __init__(self, store: FleetStore, settings: HealthSettings, stale_after_s: float, prober: Prober,
                 remediator: Remediator | None = None, *, is_leader: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 spread_s: float | None = None) -> None:
        self._settings = settings
        self._stale_after_s = stale_after_s
        self._store = store
        self._prober = prober
        self._remediator = remediator
        self._is_leader = is_leader
        self._clock = clock
        self._wall_clock = wall_clock
        self._seen: dict[str, _Seen] = {}
        self._view = FleetView(store, live=True)
        self._spread_s = settings.probe_interval_s * PROBE_SPREAD if spread_s is None else spread_s
        self._slots = asyncio.Semaphore(PROBE_CONCURRENCY)
        self.stats = MonitorStats()

    def memory(self, worker_id: str) -> HealthMemory | None:
        seen = self._seen.get(worker_id)
        return seen.memory if seen else None

    async def round(self) -> None:
        """One probe of every worker and the writes and remedies that follow."""
        if not self._is_leader():
            self._seen.clear()  # a new leader starts from what Redis says
            self._view.mark_stale()
            return
        await self._view.sync()
        records = self._view.workers()
        passive = await self._store.read_passive_failures([r.id for r in records])
        step = max(self._spread_s / len(records), 1 / PROBES_PER_S) if records else 0.0
        probes = await asyncio.gather(*(self._probe(record, i * step) for i, record in enumerate(records)))
        self.stats.rounds += 1
        now = self._clock()
        wall = self._wall_clock()
        verdicts = []
        for record, results in zip(records, probes, strict=True):
            registration = (record.address, record.registered_at)
            seen = self._seen.get(record.id)
            total = passive.get(record.id, 0)
            if seen is None or seen.registration != registration:
                seen = _Seen(registration, initial_memory(record), total)
                self._seen[record.id] = seen
            new_failures = max(0, total - seen.passive_total)
            seen.passive_total = total
            fresh = record.metrics_at > 0 and wall - record.metrics_at <= self._stale_after_s
            for probe in results:
                self.stats.probes += 1
                self.stats.probe_failures += 0 if probe.ok else 1
                verdict = judge(seen.memory, record, probe, new_failures, self._settings, now, fresh)
                seen.memory, new_failures = verdict.memory, 0
            verdicts.append((record, verdict))
        for gone in set(self._seen) - {r.id for r in records}:
            del self._seen[gone]
        await self._write_states(verdicts)
        for record, verdict in verdicts:
            await self._remedy(record, verdict)

    async def _probe(self, record: WorkerRecord, delay_s: float) -> list[ProbeResult]:
        """The worker's probe, and when a serving worker fails it, the probes that confirm the failure, spaced by
        ``CONFIRM_SHARE`` of the interval: a dead worker is ejected within the round that first finds it, not
        ``failures_to_fail`` rounds later (at 5,000 workers a round takes 5 s)."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        async with self._slots:
            results = [await self._prober.probe(record)]
        seen = self._seen.get(record.id)
        if seen is None or seen.memory.state not in HEALTHY or seen.registration[1] != record.registered_at:
            return results
        while not results[-1].ok and seen.memory.failures + len(results) < self._settings.failures_to_fail:
            await asyncio.sleep(self._settings.probe_interval_s * CONFIRM_SHARE)
            async with self._slots:
                results.append(await self._prober.probe(record))
        return results

    async def _write_states(self, verdicts: list[tuple[WorkerRecord, Verdict]]) -> None:
        """The round's state changes in one batch (one announcement for all of them)."""
        changes = {record.id: (record, verdict) for record, verdict in verdicts if verdict.state != record.state}
        if not changes:
            return
        written = await self._store.set_states({worker_id: v.state for worker_id, (_, v) in changes.items()})
        self.stats.batches += 1
        for worker_id in written:
            record, verdict = changes[worker_id]
            key = f"{record.state.value}->{verdict.state.value}"
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
            log.info("worker %s: %s -> %s (%s)", record.id, record.state.value, verdict.state.value,
                     verdict.reason or "probe ok")

    async def _remedy(self, record: WorkerRecord, verdict: Verdict) -> None:
        if verdict.remedy is not Remedy.NONE:
            self.stats.remedies[verdict.remedy.value] = self.stats.remedies.get(verdict.remedy.value, 0) + 1
            log.warning("worker %s: %s (%s)", record.id, verdict.remedy.value, verdict.reason)
            if self._remediator is not None:
                await self._remediator.remedy(record.id, verdict.remedy, verdict.reason)


async def run_monitor(monitor: HealthMonitor, interval_s: float, stop: asyncio.Event | None = None) -> None:
    """Rounds every ``interval_s`` (a round that overruns is followed at once by the next)."""
    redis = OutageLog(log, "redis unreachable (%s); worker states are not updated",
                      "redis reachable again; health monitor resumed")

    async def step() -> None:
        await monitor.round()
        redis.up()

    await every(interval_s, stop or asyncio.Event(), step, redis.down, count_step=True)
