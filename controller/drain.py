"""Draining: a worker stops taking new requests, finishes what it has, then goes.

Draining in Redis makes Envoy's endpoint DRAINING (no new connections from its load balancer) and extproc
stop choosing the worker; requests and streams already on it continue, because Envoy never moves an
open stream. The worker may stop once nothing is in flight on it — neither in extproc's cross-replica
count nor in the engine's own running/waiting queues — or when the grace period ends.

A drain outlives the controller that began it: how it ends and when it began are kept in Redis
(``FleetStore.record_drain``) until it is over, and a controller that takes the leader lease over resumes
every drain left there (``resume``), its grace period still counted from the original start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from poolgate.kernel.cancel import cancel_and_wait
from poolgate.kernel.config import DrainSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.drain")


@dataclass(frozen=True)
class DrainView:
    """What the drainer sees of a draining worker at one moment."""

    elapsed_s: float
    registered: bool
    inflight: int
    running: int
    waiting: int


def drain_finished(view: DrainView, settings: DrainSettings) -> str | None:
    """Why the drain is over, or None while the worker must keep serving what it has."""
    if not view.registered:
        return "the worker left the registry"
    if view.elapsed_s >= settings.grace_s:
        return (f"grace period of {settings.grace_s:g} s ended with {view.inflight} in flight, "
                f"{view.running} running, {view.waiting} waiting")
    if view.elapsed_s < settings.settle_s:
        return None  # every extproc replica must have seen Draining before "0 in flight" means anything
    if view.inflight == 0 and view.running == 0 and view.waiting == 0:
        return f"nothing in flight after {view.elapsed_s:.1f} s"
    return None


class DrainEnd(StrEnum):
    """What happens to the worker when its drain is over (for a worker this controller runs)."""

    STOP = "stop"
    RESTART = "restart"
    SLEEP = "sleep"
    """The engine sleeps (vLLM's sleep mode) and stays registered, to be woken instead of started."""


@dataclass
class DrainStatus:
    worker_id: str
    started_at: float
    finished: str | None = None


class Drainer:
    """Runs drains as tasks, one per worker; ``then`` stops or replaces the worker when its drain ends."""

    def __init__(self, store: FleetStore, settings: DrainSettings,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self._settings = settings
        self._clock = clock
        self._wall = wall
        self._tasks: dict[str, asyncio.Task[str]] = {}
        self.history: dict[str, DrainStatus] = {}

    def draining(self, worker_id: str) -> bool:
        task = self._tasks.get(worker_id)
        return task is not None and not task.done()

    async def start(self, worker_id: str, end: DrainEnd, then: Callable[[], Awaitable[None]]) -> bool:
        """Mark the worker Draining and finish the drain in the background (``then`` runs when it is over);
        False if it is not registered."""
        if self.draining(worker_id):
            return True
        await self._store.record_drain(worker_id, end.value, self._wall())
        if not await self._store.set_state(worker_id, WorkerState.DRAINING):
            await self._store.forget_drain(worker_id)
            return False
        self._run(worker_id, self._clock(), then)
        log.info("worker %s: draining (grace %.0f s)", worker_id, self._settings.grace_s)
        return True

    def resume(self, worker_id: str, started_at: float, then: Callable[[], Awaitable[None]]) -> None:
        """Finish a drain another controller began at ``started_at`` (epoch seconds)."""
        if self.draining(worker_id):
            return
        elapsed = max(0.0, self._wall() - started_at)
        self._run(worker_id, self._clock() - elapsed, then)
        log.info("worker %s: resuming a drain begun %.1f s ago", worker_id, elapsed)

    def _run(self, worker_id: str, started_at: float, then: Callable[[], Awaitable[None]]) -> None:
        status = DrainStatus(worker_id, started_at)
        self.history[worker_id] = status
        self._tasks[worker_id] = asyncio.create_task(self._finish(status, then), name=f"drain-{worker_id}")

    async def wait(self, worker_id: str) -> str | None:
        task = self._tasks.get(worker_id)
        return await task if task is not None else None

    async def _view(self, status: DrainStatus) -> DrainView:
        records = {r.id: r for r in await self._store.read_fleet()}
        record: WorkerRecord | None = records.get(status.worker_id)
        inflight = (await self._store.read_inflight([status.worker_id])).get(status.worker_id, 0)
        elapsed = self._clock() - status.started_at
        if record is None:
            return DrainView(elapsed, False, inflight, 0, 0)
        return DrainView(elapsed, True, inflight, record.running, record.waiting)

    async def _finish(self, status: DrainStatus, then: Callable[[], Awaitable[None]]) -> str:
        while True:
            view = await self._view(status)
            reason = drain_finished(view, self._settings)
            if reason is not None:
                break
            await asyncio.sleep(self._settings.poll_s)
        status.finished = reason
        log.info("worker %s: drain over (%s)", status.worker_id, reason)
        await then()
        await self._store.forget_drain(status.worker_id)
        return reason

    async def close(self) -> None:
        await cancel_and_wait(self._tasks.values())
