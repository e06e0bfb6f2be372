"""The instance controller: turns remedies, operator commands and scale targets into backend calls.

Every way a worker leaves goes through a drain (Draining → in-flight 0 → stop), except a worker that is
already Failed: nothing reaches it, so it is replaced at once. Actions happen only on the leader.

A pool that sleeps its surplus (``pools.*.sleep_level``) drains a worker to sleep instead: once nothing is in
flight its engine gets ``POST /sleep?level=N``, its record the sleep level (extproc routes nothing to it from
that write on, before the agent's next scrape) and Ready again. Scaling up wakes sleeping workers first
(``POST /wake_up``, seconds) and launches processes only for the rest. A sleeping worker counts toward the
backend's processes but not toward the pool's size.

A pool with ``standby_workers`` keeps that many spares asleep (``keep_standby``): it launches them ahead of need
and, once a spare's engine serves, drains it to sleep like any surplus. A worker bound for sleep (a spare starting
or draining to its first sleep, a surplus worker draining to sleep) counts neither toward the pool's size nor
among its sleepers, but toward the standby; a scale-up that finds nobody asleep claims a spare still starting
before it launches anything. Which workers are bound for sleep is this controller's own record: a new leader finds
a spare awake and gives it back to the autoscaler's next decision. Once an engine of the pool refuses to sleep (a
build without sleep mode), the pool keeps no standby: every spare would be started only to be stopped; nor does a
pool whose backend launches workers it cannot name yet (Kubernetes: pods get their names from the Deployment), after
one launch whose workers serve until the autoscaler puts the surplus to sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from controller.backend import InstanceBackend
from controller.drain import DrainEnd, Drainer
from controller.health import Remedy
from poolgate.kernel.errors import Refused
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.instances")


class NotLeader(Refused):
    """Another controller holds the lease; it alone acts."""


@dataclass(frozen=True)
class ScaleResult:
    pool: str
    before: int
    target: int
    started: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()
    woken: tuple[str, ...] = ()
    claimed: tuple[str, ...] = ()
    """Spares still starting that will serve instead of going to sleep."""
    wake_s: float | None = None
    """How long the slowest of the wake-ups took (None: none)."""


@dataclass(frozen=True)
class PoolWorkers:
    """A pool's workers as scaling sees them."""

    awake: list[str]
    """Serving or starting, not draining, not bound for sleep: the pool's size."""
    asleep: list[WorkerRecord]
    bound_for_sleep: list[str] = field(default_factory=list)
    """Workers sent to sleep that do not sleep yet: standby spares (starting, or draining to their first sleep)
    and surplus draining to sleep."""
    records: dict[str, WorkerRecord] = field(default_factory=dict)


SLEEP_CALL_TIMEOUT_S = 120.0
"""A wake-up copies the weights back to the GPU: seconds for large models, but never this long."""


async def _engine_call(record: WorkerRecord, path: str) -> None:
    """``POST path`` to the worker's engine; raises ``aiohttp.ClientError`` or ``TimeoutError`` on failure."""
    timeout = aiohttp.ClientTimeout(total=SLEEP_CALL_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
            f"http://{record.address}{path}") as response:
        response.raise_for_status()


class InstanceController:
    def __init__(self, store: FleetStore, backend: InstanceBackend, drainer: Drainer,
                 is_leader: Callable[[], bool] = lambda: True) -> None:
        self._store = store
        self.backend = backend
        self.drainer = drainer
        self._is_leader = is_leader
        self._to_sleep: dict[str, set[str]] = {}
        """Per pool: the workers bound for sleep (``PoolWorkers.bound_for_sleep``)."""
        self._no_standby: dict[str, str] = {}
        """Pools that keep no standby, and why: one of their engines refused to sleep (each spare would be started,
        refused and stopped again, a launch every round), or the backend does not name what it launches (the spares
        could not be told from the pool's other workers, and would be launched again every round)."""

    def _require_leader(self) -> None:
        if not self._is_leader():
            raise NotLeader("this controller does not hold the leader lease")

    async def remedy(self, worker_id: str, remedy: Remedy, reason: str) -> None:
        """The health monitor's call: replace a failed worker, drain-and-replace a leaking one."""
        if not self._is_leader():
            return
        if not self.backend.owns(worker_id):
            log.warning("worker %s needs %s (%s) but is not run by this controller; left Failed/as is",
                        worker_id, remedy.value, reason)
            return
        if remedy is Remedy.REPLACE:
            log.warning("replacing worker %s: %s", worker_id, reason)
            await self.backend.restart(worker_id)
        elif remedy is Remedy.DRAIN_AND_REPLACE:
            log.warning("draining worker %s to replace it: %s", worker_id, reason)
            await self.drainer.start(worker_id, DrainEnd.RESTART, self._ending(worker_id, DrainEnd.RESTART))

    async def drain(self, worker_id: str) -> bool:
        """Operator drain: a worker this controller runs is stopped afterwards; another stays Draining."""
        self._require_leader()
        return await self.drainer.start(worker_id, DrainEnd.STOP, self._ending(worker_id, DrainEnd.STOP))

    async def resume_drains(self) -> list[str]:
        """On taking the lease: finish every drain the previous leader left in Redis; returns their ids."""
        if not self._is_leader():
            return []
        resumed = []
        for worker_id, (end, started_at) in sorted((await self._store.read_drains()).items()):
            if self.drainer.draining(worker_id):
                continue
            ending = DrainEnd(end) if end in {e.value for e in DrainEnd} else DrainEnd.STOP
            self.drainer.resume(worker_id, started_at, self._ending(worker_id, ending))
            resumed.append(worker_id)
        return resumed

    def _ending(self, worker_id: str, end: DrainEnd, level: int = 1) -> Callable[[], Awaitable[None]]:
        """What a finished drain does: stop, restart or put to sleep (at ``level``) a worker the backend runs;
        another stays Draining."""
        async def finish() -> None:
            if not self.backend.owns(worker_id):
                return
            if end is DrainEnd.RESTART:
                await self.backend.restart(worker_id)
            elif end is DrainEnd.SLEEP:
                await self._fall_asleep(worker_id, level)
            else:
                await self.backend.stop(worker_id)

        return finish

    async def _fall_asleep(self, worker_id: str, level: int) -> None:
        """The end of a drain to sleep: the engine sleeps, the record says so, and the worker is Ready again
        (stopped instead when its engine refuses)."""
        record = (await self._store.read_workers([worker_id])).get(worker_id)
        if record is None:
            await self.backend.stop(worker_id)
            return
        try:
            await _engine_call(record, f"/sleep?level={level}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("worker %s: sleep refused (%s); stopping it instead", worker_id, exc)
            self._no_standby.setdefault(record.pool, f"worker {worker_id} refused to sleep")
            await self.backend.stop(worker_id)
            return
        await self._store.update_live(worker_id, announce=True, sleep_level=level)
        await self._store.set_state(worker_id, WorkerState.READY)
        log.info("worker %s: asleep at level %d", worker_id, level)

    async def _wake(self, record: WorkerRecord) -> bool:
        try:
            await _engine_call(record, "/wake_up")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("worker %s: wake-up failed (%s)", record.id, exc)
            return False
        await self._store.update_live(record.id, announce=True, sleep_level=0)
        return True

    async def active_workers(self, pool: str) -> list[str]:
        """The pool's workers run by the backend and not draining: its size, its sleepers and the standby spares
        still starting (``workers`` tells them apart)."""
        return [w for w in await self.backend.pool_workers(pool) if not self.drainer.draining(w)]

    def bound_for_sleep(self, pool: str) -> set[str]:
        """The pool's workers bound for sleep (as of the last look at the pool)."""
        return set(self._to_sleep.get(pool, ()))

    async def workers(self, pool: str) -> PoolWorkers:
        """The pool's workers told apart (awake, asleep, bound for sleep); forgets those bound for sleep that now
        sleep or are gone."""
        run = await self.backend.pool_workers(pool)
        active = [w for w in run if not self.drainer.draining(w)]
        records = {r.id: r for r in await self._store.read_fleet() if r.id in run}
        asleep = [records[w] for w in active if w in records and records[w].sleep_level]
        sleeping = {r.id for r in asleep}
        bound = self._to_sleep.setdefault(pool, set())
        bound &= set(run) - sleeping  # asleep at last, or gone (a sleep refused stops it): no longer on their way
        return PoolWorkers([w for w in active if w not in sleeping and w not in bound], asleep, sorted(bound),
                           records)

    async def scale(self, pool: str, target: int, sleep_level: int = 0) -> ScaleResult:
        """Bring the pool to ``target`` awake workers: wake sleeping ones, claim starting spares, launch the rest,
        drain the surplus (to sleep at ``sleep_level``, or to a stop when 0)."""
        self._require_leader()
        pool_workers = await self.workers(pool)
        awake, asleep = pool_workers.awake, pool_workers.asleep
        if target > len(awake):
            began = time.monotonic()
            calls = asleep[:target - len(awake)]
            woke = [r.id for r, ok in zip(calls, await asyncio.gather(*(self._wake(r) for r in calls)),
                                          strict=True) if ok]
            wake_s = time.monotonic() - began if woke else None
            missing = target - len(awake) - len(woke)
            claimed = [w for w in pool_workers.bound_for_sleep if not self.drainer.draining(w)][:max(0, missing)]
            self._to_sleep[pool] -= set(claimed)
            missing -= len(claimed)
            started = await self.backend.launch(pool, missing) if missing > 0 else []
            log.info("pool %s: %d -> %d workers, woke %s%s, started %s%s", pool, len(awake), target,
                     ", ".join(woke) or "none", f" in {wake_s:.2f} s" if wake_s is not None else "",
                     ", ".join(started) or "none", f"; claimed starting spares {', '.join(claimed)}" if claimed else "")
            return ScaleResult(pool, len(awake), target, started=tuple(started), woken=tuple(woke),
                               claimed=tuple(claimed), wake_s=wake_s)
        if target == len(awake):
            return ScaleResult(pool, len(awake), target)
        victims = await self._victims(awake, len(awake) - target)
        end = DrainEnd.SLEEP if sleep_level else DrainEnd.STOP
        for worker_id in victims:
            drained = await self.drainer.start(worker_id, end, self._ending(worker_id, end, sleep_level or 1))
            if not drained:  # not registered yet: nothing can be in flight on it
                await self.backend.stop(worker_id)
            elif end is DrainEnd.SLEEP:
                self._to_sleep.setdefault(pool, set()).add(worker_id)
        log.info("pool %s: %d -> %d workers, draining %s%s", pool, len(awake), target, ", ".join(victims),
                 f" to sleep at level {sleep_level}" if sleep_level else "")
        return ScaleResult(pool, len(awake), target, draining=tuple(victims))

    async def keep_standby(self, pool: str, wanted: int, sleep_level: int) -> list[str]:
        """Keep ``wanted`` workers asleep or bound for sleep: a spare whose engine now serves is drained to sleep (a
        request sent to it meanwhile ends first), and the missing ones are launched. Returns the launched ids."""
        self._require_leader()
        if pool in self._no_standby:
            return []
        pool_workers = await self.workers(pool)
        for worker_id in pool_workers.bound_for_sleep:
            record = pool_workers.records.get(worker_id)
            serving = record is not None and record.state in (WorkerState.READY, WorkerState.BUSY)
            if serving and not self.drainer.draining(worker_id):
                await self.drainer.start(worker_id, DrainEnd.SLEEP,
                                         self._ending(worker_id, DrainEnd.SLEEP, sleep_level))
                log.info("pool %s: spare %s serves; draining it to sleep at level %d", pool, worker_id, sleep_level)
        missing = wanted - len(pool_workers.asleep) - len(pool_workers.bound_for_sleep)
        if missing <= 0:
            return []
        launched = await self.backend.launch(pool, missing)
        self._to_sleep.setdefault(pool, set()).update(launched)
        if len(launched) < missing:
            self._no_standby[pool] = "the backend does not name the workers it launches"
            log.warning("pool %s: %d standby worker(s) launched unnamed; they serve until the autoscaler puts the "
                        "surplus to sleep, and no more are launched (%s)", pool, missing - len(launched),
                        self._no_standby[pool])
        log.info("pool %s: launched %s as standby (to sleep once serving)", pool, ", ".join(launched) or "unnamed")
        return launched

    async def _victims(self, active: list[str], count: int) -> list[str]:
        """Fewest requests in flight first (the quickest drains); unregistered (still starting) before all."""
        registered = {r.id: r for r in await self._store.read_fleet()}
        inflight = await self._store.read_inflight(active)

        def load(worker_id: str) -> tuple[int, int, str]:
            record = registered.get(worker_id)
            if record is None:
                return (0, -1, worker_id)
            return (1, inflight.get(worker_id, 0) + record.running + record.waiting, worker_id)

        return sorted(active, key=load)[:count]
