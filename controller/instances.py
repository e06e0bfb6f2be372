"""The instance controller: turns remedies, operator commands and scale targets into backend calls.

Every way a worker leaves goes through a drain (Draining → in-flight 0 → stop), except a worker that is
already Failed: nothing reaches it, so it is replaced at once. Actions happen only on the leader.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from controller.backend import InstanceBackend
from controller.drain import DrainEnd, Drainer
from controller.health import Remedy
from poolgate.kernel.errors import PoolgateError
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.instances")


class NotLeader(PoolgateError):
    """Another controller holds the lease; it alone acts."""


@dataclass(frozen=True)
class ScaleResult:
    pool: str
    before: int
    target: int
    started: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()


class InstanceController:
    def __init__(self, store: FleetStore, backend: InstanceBackend, drainer: Drainer,
                 is_leader: Callable[[], bool] = lambda: True) -> None:
        self._store = store
        self.backend = backend
        self.drainer = drainer
        self._is_leader = is_leader

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

    def _ending(self, worker_id: str, end: DrainEnd) -> Callable[[], Awaitable[None]]:
        """What a finished drain does: stop or restart a worker the backend runs; another stays Draining."""
        async def finish() -> None:
            if not self.backend.owns(worker_id):
                return
            if end is DrainEnd.RESTART:
                await self.backend.restart(worker_id)
            else:
                await self.backend.stop(worker_id)

        return finish

    async def active_workers(self, pool: str) -> list[str]:
        """The pool's workers that count toward its size: run by the backend and not draining."""
        return [w for w in await self.backend.pool_workers(pool) if not self.drainer.draining(w)]

    async def scale(self, pool: str, target: int) -> ScaleResult:
        """Bring the pool to ``target`` workers: launch the missing ones, drain the surplus."""
        self._require_leader()
        active = await self.active_workers(pool)
        if target > len(active):
            started = await self.backend.launch(pool, target - len(active))
            log.info("pool %s: %d -> %d workers, started %s", pool, len(active), target, ", ".join(started))
            return ScaleResult(pool, len(active), target, started=tuple(started))
        if target == len(active):
            return ScaleResult(pool, len(active), target)
        victims = await self._victims(active, len(active) - target)
        for worker_id in victims:
            if not await self.drain(worker_id):  # not registered yet: nothing can be in flight on it
                await self.backend.stop(worker_id)
        log.info("pool %s: %d -> %d workers, draining %s", pool, len(active), target, ", ".join(victims))
        return ScaleResult(pool, len(active), target, draining=tuple(victims))

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
