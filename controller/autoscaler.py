"""The autoscaler loop: sample each scalable pool, decide (``controller.autoscale``), act, log, count.

Runs on the leader only. Samples come from the registry (workers' engine facts from the agent), extproc's
per-worker in-flight counts and its per-pool queue counts (together the pool's demand); the history kept per
pool is just long enough for the longest window. The loop also learns each pool's start-up time from its own
launches (``StartupTimes``: from the moment a worker is first seen starting to the moment it serves), and
hands the decision the figure, so a pool of real vLLM engines plans minutes ahead and one of quick workers
seconds.

A pool with ``standby_workers`` has its spares kept every round, after the decision (``InstanceController.
keep_standby``): as many as the awake target leaves room for under ``max_workers``.

A pool with no awake worker is also looked at every ``EMPTY_POOL_POLL_S`` between rounds (one read of extproc's
queue count for it): the first request to a pool at zero waits for a start-up or a wake-up, not for the next
round as well.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from controller.autoscale import Action, Decision, PoolSample, decide
from controller.backend import PlacementRefused
from controller.instances import InstanceController
from controller.periodic import every
from poolgate.kernel.config import AutoscaleSettings
from poolgate.kernel.fleet import WorkerState
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.autoscale")

HOLD_LOG_S = 10.0
"""A pool held above its minimum says why at most this often."""
LAUNCHES_KEPT = 5
"""The learned start-up time is the mean of this many of the pool's latest launches."""
EMPTY_POOL_POLL_S = 0.1
"""How often a pool with no awake worker is checked for a request waiting on it, between rounds."""


class StartupTimes:
    """A pool's start-up time, learned from its own launches: first seen starting → serving."""

    def __init__(self) -> None:
        self._starting: dict[str, float] = {}
        self._served: set[str] = set()
        self._measured: deque[float] = deque(maxlen=LAUNCHES_KEPT)

    def observe(self, starting: set[str], serving: set[str], now: float) -> dict[str, float]:
        """``starting``: the pool's workers not serving yet; ``serving``: those that serve now. A worker that
        served once and stops serving (failed, restarted in place) is not a launch. Returns the start-ups
        measured now (worker id → seconds)."""
        measured = {}
        for worker_id in starting - self._served:
            self._starting.setdefault(worker_id, now)
        for worker_id in list(self._starting):
            if worker_id in serving:
                measured[worker_id] = now - self._starting.pop(worker_id)
                self._measured.append(measured[worker_id])
            elif worker_id not in starting:
                del self._starting[worker_id]  # stopped before it served: no figure
        self._served = (self._served | serving) & (starting | serving)
        return measured

    def estimate(self, default_s: float) -> float:
        return sum(self._measured) / len(self._measured) if self._measured else default_s


class Autoscaler:
    def __init__(self, store: FleetStore, settings: AutoscaleSettings, instances: InstanceController,
                 registry: CollectorRegistry, *, is_leader: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._store = store
        self._instances = instances
        self._is_leader = is_leader
        self._clock = clock
        self._history: dict[str, deque[PoolSample]] = {p: deque() for p in self._settings.pools}
        self.startup = {p: StartupTimes() for p in self._settings.pools}
        self._wakes: dict[str, deque[float]] = {p: deque(maxlen=LAUNCHES_KEPT) for p in self._settings.pools}
        self._last_change: dict[str, tuple[float, Action]] = {}
        """Per pool: when it last changed size, and which way."""
        self._decisions = Counter("poolgate_autoscale_decisions", "Autoscaler decisions by pool and action.",
                                  ["pool", "action"], registry=registry)
        self.last: dict[str, Decision] = {}
        self._hold_logged_at: dict[str, float] = {}
        self._empty: set[str] = set()
        """Pools whose latest sample had no awake worker and that are left as they are (``wake_empty``)."""
        self._acting = asyncio.Lock()
        """One pool step at a time: a round and a wake-up check must not both launch for the same request."""

    def _keep_s(self, pool: str) -> float:
        """History long enough for the longest window, the learned start-up time's among them."""
        settings = self._settings
        return max(settings.up_sustain_s, settings.down_cooldown_s, settings.trend_window_s,
                   settings.demand_window_s, self._startup_s(pool), self._settings.wake_s) + 2 * settings.interval_s

    def _startup_s(self, pool: str) -> float:
        return self.startup[pool].estimate(self._settings.startup_s)

    def _wake_s(self, pool: str) -> float:
        """The mean of the pool's latest wake-ups (the settings' figure before the first)."""
        wakes = self._wakes[pool]
        return sum(wakes) / len(wakes) if wakes else self._settings.wake_s

    async def sample(self, pool: str, now: float) -> PoolSample:
        records = [r for r in await self._store.read_fleet() if r.pool == pool]
        serving = [r for r in records if r.state in (WorkerState.READY, WorkerState.BUSY)]
        active = await self._instances.active_workers(pool)
        asleep = {r.id for r in serving if r.sleep_level and r.id in active}
        # Workers bound for sleep (standby spares on their way) are neither the pool's size nor its sleepers; a
        # spare's launch still teaches the pool's start-up time.
        bound = self._instances.bound_for_sleep(pool) - asleep
        spares_serving = {r.id for r in serving if r.id in bound}
        serving = [r for r in serving if r.id not in asleep and r.id not in bound]
        queued = await self._store.read_queued(pool)
        inflight = await self._store.read_inflight([r.id for r in serving])
        kv = sum(r.kv_usage for r in serving) / len(serving) if serving else 0.0
        ready = {r.id for r in serving if r.id in active}
        if pool in self.startup:
            times = self.startup[pool]
            starting = set(active) - ready - asleep - spares_serving
            for worker_id, took in times.observe(starting, ready | spares_serving, now).items():
                log.info("pool %s: worker %s served %.1f s after it was first seen starting (start-up now %.1f s)",
                         pool, worker_id, took, times.estimate(self._settings.startup_s))
        ttfts = [r.ttft_ewma_s for r in serving if r.ttft_ewma_s >= 0]
        # A starved or unreachable engine's scrape goes stale and its facts read 0: extproc's in-flight count
        # of the worker (requests sent and not yet ended) keeps a busy pool from looking idle.
        running = sum(max(r.running, inflight.get(r.id, 0) - r.waiting) for r in serving)
        # Demand: what extproc has sent and not seen end (the engines' own counts where they read more), plus
        # what it holds for the pool.
        carried = sum(max(inflight.get(r.id, 0), r.running + r.waiting) for r in serving)
        return PoolSample(at=now, workers=len(set(active) - asleep - bound), ready=len(ready),
                          waiting=sum(r.waiting for r in serving) + queued,
                          running=running, kv_usage=kv,
                          ttft_s=sum(ttfts) / len(ttfts) if ttfts else -1.0,
                          demand=float(carried + queued), sleeping=len(asleep))

    def _log_hold(self, pool: str, min_workers: int, decision: Decision, now: float) -> None:
        """Why a pool above its minimum keeps its size, at most every ``HOLD_LOG_S`` (an operator waiting
        for a scale-down reads what holds it up)."""
        if decision.target <= min_workers or now - self._hold_logged_at.get(pool, -math.inf) < HOLD_LOG_S:
            log.debug("pool %s: hold at %d (%s)", pool, decision.target, decision.reason)
            return
        self._hold_logged_at[pool] = now
        log.info("pool %s: hold at %d (%s)", pool, decision.target, decision.reason)

    async def step(self) -> None:
        """One sample and decision per pool; acts when the decision changes the size."""
        if not self._is_leader():
            for history in self._history.values():
                history.clear()
            return
        for pool in self._settings.pools:
            await self._step_pool(pool)

    async def wake_empty(self) -> None:
        """Step at once each pool with no awake worker that a request now waits for (extproc's queue count)."""
        if not self._is_leader():
            return
        for pool in list(self._empty):
            if await self._store.read_queued(pool) > 0:
                await self._step_pool(pool)

    async def _step_pool(self, pool: str) -> None:
        async with self._acting:
            bounds = self._settings.pools[pool]
            now = self._clock()
            history = self._history[pool]
            history.append(await self.sample(pool, now))
            keep_s = self._keep_s(pool)
            while history and now - history[0].at > keep_s:
                history.popleft()
            last_at, last_action = self._last_change.get(pool, (None, None))
            decision = decide(list(history), bounds, self._settings, now, last_at,
                              startup_s=self._startup_s(pool), wake_s=self._wake_s(pool), last_action=last_action)
            self._decisions.labels(pool=pool, action=decision.action.value).inc()
            self.last[pool] = decision
            if history[-1].workers == 0 and decision.action is Action.HOLD:
                self._empty.add(pool)
            else:
                self._empty.discard(pool)
            if decision.action is Action.HOLD:
                self._log_hold(pool, bounds.min_workers, decision, now)
            else:
                await self._act(pool, decision, now)
            if bounds.standby_workers:
                try:
                    await self._instances.keep_standby(
                        pool, min(bounds.standby_workers, bounds.max_workers - decision.target), bounds.sleep_level)
                except PlacementRefused as exc:
                    log.warning("pool %s: standby launch refused: %s", pool, exc)

    async def _act(self, pool: str, decision: Decision, now: float) -> None:
        log.info("pool %s: scale %s to %d (%s)", pool, decision.action.value, decision.target, decision.reason)
        try:
            result = await self._instances.scale(pool, decision.target,
                                                 sleep_level=self._settings.pools[pool].sleep_level)
            if result.wake_s is not None:
                self._wakes[pool].append(result.wake_s)
        except PlacementRefused as exc:
            log.warning("pool %s: scale-up refused: %s", pool, exc)
        self._last_change[pool] = (now, decision.action)
        if not self._settings.worker_capacity:
            self._history[pool].clear()  # the pressure rules look at the pool as it is after this change


async def run_autoscaler(autoscaler: Autoscaler, interval_s: float, stop: asyncio.Event) -> None:
    def skipped(exc: Exception) -> None:
        log.warning("autoscaler skipped a round: %s", exc)

    await asyncio.gather(every(interval_s, stop, autoscaler.step, skipped),
                         every(min(interval_s, EMPTY_POOL_POLL_S), stop, autoscaler.wake_empty, skipped))
