"""The hold stage: requests that fit on no worker now wait in the priority queue (``flow_queue``), which
releases them by class, tenant share, then deadline and predicted prefill (short and urgent ones first).

extproc first asks Envoy for a longer message timeout (``Wait``), then a release pass re-picks queued
requests in the queue's order whenever capacity may have changed (a request here ended, the fleet snapshot
was refreshed, or a short poll). Past its class's deadline the request gets one last pick; a client that
goes away leaves the queue at once. Placing and refusing are the director's: it hands itself (``Dispatch``) to
each call that may place or refuse, and the stage keeps no reference to it. The queue is the replica's
(``extproc.replica.ReplicaState``, built by the wiring); this stage owns its metrics and the waiters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from extproc.errors import queue_full
from extproc.flow_queue import FlowQueue, QueueEntry
from extproc.metrics import Metrics
from extproc.pipeline.context import Queued, RequestContext
from extproc.pipeline.outcomes import Final, Refused, Routing, Wait

HOLD_TIMEOUT_MARGIN_S = 2.0
"""Asked of Envoy on top of the class's deadline, so the final answer (placed or 429) always arrives in time."""
HOLD_POLL_S = 0.1
"""Held requests are re-tried at least this often even when no change was announced."""


class CapacitySignal:
    """Says capacity may have changed: calls the listeners (the release pass)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        for listener in self._listeners:
            listener()


class Dispatch(Protocol):
    """What the queue asks of the director."""

    def place_held(self, context: RequestContext) -> Final | None:
        """Place a queued request now; None when it still fits nowhere."""

    def refuse(self, context: RequestContext, refused: Refused) -> Refused: ...


class Hold:
    def __init__(self, max_wait_s: Sequence[float], queue: FlowQueue, metrics: Metrics,
                 timer: Callable[[], float], capacity_changed: CapacitySignal | None = None) -> None:
        """``max_wait_s``: each priority class's deadline, highest class first; ``queue``: the replica's."""
        self.max_wait_s = tuple(max_wait_s)
        self.queue = queue
        self.capacity_changed = capacity_changed or CapacitySignal()
        """Notified when a request here ends and (wired by ``serve``) when the fleet snapshot is refreshed."""
        self._metrics = metrics
        self._timer = timer
        self._pass_pending = False
        self._last_pass = 0.0
        self._queue_changed: Callable[[], None] | None = None

    def on_queue_change(self, listener: Callable[[], None]) -> None:
        """Called whenever a request joins or leaves the queue (the watcher publishes the queue's report)."""
        self._queue_changed = listener

    def may_hold(self, priority: int) -> bool:
        return self.max_wait_s[priority] > 0 and self.queue.max_entries > 0

    def retry_after_s(self) -> int:
        return max(1, round(min(self.max_wait_s, default=1.0)))

    def enqueue(self, dispatch: Dispatch, context: RequestContext, domain: Hashable, prefill_s: float = 0.0,
                cold_start_s: float | None = None) -> Routing:
        """Queue the request among others waiting for the same capacity (in the queue's order: class, fair
        share, then deadline and ``prefill_s``, its predicted prefill): ``Wait``, or the final outcome when
        the queue is full or it was placed at once (it only waited behind requests that now fit too).
        ``cold_start_s``: it waits for a pool scaled to zero to start a worker (``cold_start``), this long."""
        tenant, request = context.tenant, context.request
        assert tenant is not None and request is not None
        pushed = self.queue.push(domain, tenant.name, tenant.priority, request.total_tokens, tenant.weight, context,
                                 prefill_s, max_wait_s=cold_start_s)
        for shed in pushed.shed:
            self._shed(dispatch, shed)
        if pushed.entry is None:
            return dispatch.refuse(context, self._queue_full(context))
        waiter: asyncio.Future[Final] = asyncio.get_running_loop().create_future()
        context.queued = Queued(pushed.entry, waiter, cold_start=cold_start_s is not None)
        self._metrics.queue_depth.labels(tenant.priority_class, tenant.name).inc()
        if self._queue_changed is not None:
            self._queue_changed()
        self.release_pass(dispatch)
        if waiter.done():
            return waiter.result()
        return Wait(pushed.entry.deadline - pushed.entry.enqueued_at + HOLD_TIMEOUT_MARGIN_S)

    async def wait(self, dispatch: Dispatch, context: RequestContext) -> Final | None:
        """The outcome a release pass or shedding gave; None once the deadline passed (out of the queue)."""
        assert context.queued is not None
        entry, waiter = context.queued.entry, context.queued.waiter
        while not waiter.done() and (remaining := entry.deadline - self._timer()) > 0:
            await asyncio.wait((waiter,), timeout=min(remaining, HOLD_POLL_S))
            if not waiter.done() and self._timer() - self._last_pass >= HOLD_POLL_S:
                self.release_pass(dispatch)
        if waiter.done():
            return waiter.result()
        self.leave(context, "refused")
        return None

    def leave(self, context: RequestContext, outcome: str) -> None:
        """Out of the queue without being placed (``outcome``: refused, cancelled)."""
        queued = context.queued
        if queued is not None and self.queue.remove(queued.entry):
            self._left(context, outcome)
        context.queued = None

    def release_pass(self, dispatch: Dispatch) -> None:
        """Re-pick queued requests in the queue's order against the live snapshot; a domain whose first
        candidate does not fit is skipped for the rest of the pass."""
        self._pass_pending = False
        self._last_pass = self._timer()
        blocked: set[Hashable] = set()
        while (entry := self.queue.next_candidate(blocked)) is not None:
            context: RequestContext = entry.payload
            queued = context.queued
            final = dispatch.place_held(context)
            if final is None:
                blocked.add(entry.domain)
                continue
            if context.decision is not None:
                self.queue.take(entry)
                self._left(context, "placed")
            else:
                self.leave(context, "refused")
            _resolve(queued, final)

    def request_pass(self, dispatch: Dispatch) -> None:
        """Capacity may have changed: run one release pass soon (many notifications, one pass)."""
        if self._pass_pending or not len(self.queue):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._pass_pending = True
        loop.call_soon(self.release_pass, dispatch)

    def _shed(self, dispatch: Dispatch, entry: QueueEntry) -> None:
        """Pushed out of a full queue by a request of a higher class: 429 now."""
        context: RequestContext = entry.payload
        queued = context.queued
        self._left(context, "shed")
        _resolve(queued, dispatch.refuse(context, self._queue_full(context)))

    def _queue_full(self, context: RequestContext) -> Refused:
        assert context.request is not None
        return Refused(queue_full(context.request.model, self.retry_after_s()), "queue_full")

    def _left(self, context: RequestContext, outcome: str) -> None:
        queued, tenant = context.queued, context.tenant
        context.queued = None
        if queued is None or tenant is None:
            return
        if self._queue_changed is not None:
            self._queue_changed()
        self._metrics.queue_depth.labels(tenant.priority_class, tenant.name).dec()
        self._metrics.queue_wait_seconds.labels(tenant.priority_class, outcome).observe(
            self._timer() - queued.entry.enqueued_at)


def _resolve(queued: Queued | None, final: Final) -> None:
    if queued is not None and not queued.waiter.done():
        queued.waiter.set_result(final)
