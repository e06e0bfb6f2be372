"""Every extproc process subscribes to every serving worker's KV events itself (pyzmq asyncio sockets).

So all replicas build the same index from the same events, with no state shared between them. One
subscription per worker: a SUB socket on the worker's ``kv_events_endpoint`` (all topics), a socket monitor
that tells connects from disconnects, and a short-lived DEALER on ``kv_events_replay_endpoint`` to fetch
missed batches (vLLM's replay protocol: send ``(b"", start as 8 bytes)``, read ``(b"", sequence, payload)``
until the sequence is -1). After every (re)connect it replays from the last batch it applied, which
covers what was missed while away and notices a restarted engine.

``KVEventSubscriptions.follow`` keeps the subscriptions equal to the fleet: Ready or Busy workers whose
record names an endpoint; a worker that re-registered (a restart) starts over with an empty view.

What one subscription costs a process: applying events takes ~4.4 µs per stored block (``bench/kv_index``,
loaded 2-CPU host); an engine prefilling 10k tokens/s stores ~625 blocks/s, so ~3 ms of CPU per second per
worker, ~0.3 % of a core. A few hundred workers per extproc process are affordable; at thousands, a
per-node relay (the agent republishing its node's streams as one, already decoded and merged) should take
this work off every replica: the design keeps the index's input (``EventBatch`` per worker) independent of
where it was decoded, so a relay would feed ``PrefixIndex.apply`` unchanged. Not built: the numbers do not
ask for it below ~300 workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge
from zmq.utils.monitor import parse_monitor_message

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.stream import WorkerStream
from extproc.kvcache.wire import Frame, KVEventDecodeError, split_frames
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.fleet import WorkerRecord, WorkerState

log = logging.getLogger(__name__)

SERVING = (WorkerState.READY, WorkerState.BUSY)
FOLLOW_INTERVAL_S = 0.1


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> FleetSnapshot: ...


class KvEventMetrics(Protocol):
    """The three series of ``extproc.metrics.Metrics`` the subscriptions keep current."""

    @property
    def kv_event_streams(self) -> Gauge: ...

    @property
    def kv_index_blocks(self) -> Gauge: ...

    @property
    def kv_event_gaps(self) -> Counter: ...


async def fetch_replay(context: zmq.asyncio.Context, endpoint: str, start: int, timeout_s: float) -> list[Frame]:
    """The publisher's buffered batches from ``start`` on; what arrived before ``timeout_s`` if it is slow."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    frames: list[Frame] = []
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not await dealer.poll(left * 1000):
                break
            parts = await dealer.recv_multipart()
            frame = split_frames(parts[1:] if parts and parts[0] == b"" else parts)
            if frame.sequence < 0:
                break
            frames.append(frame)
    except (zmq.ZMQError, KVEventDecodeError) as error:
        log.warning("KV events replay from %s failed: %s", endpoint, error)
    finally:
        dealer.close(linger=0)
    return frames


class Subscription:
    """One worker's SUB socket and its stream state, until cancelled."""

    def __init__(self, record: WorkerRecord, index: PrefixIndex, context: zmq.asyncio.Context,
                 clock: Callable[[], float], relearn_s: float, replay_timeout_s: float) -> None:
        self.record = record
        self.stream = WorkerStream(record.id, index, clock, relearn_s)
        self._context = context
        self._replay_timeout_s = replay_timeout_s

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.record.kv_events_endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                for socket, _ in await poller.poll():
                    if socket is monitor:
                        await self._connection_event(await monitor.recv_multipart())
                    else:
                        await self._receive(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _connection_event(self, message: list[bytes]) -> None:
        event = parse_monitor_message(message)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            log.info("worker %s: KV event stream disconnected", self.record.id)
            self.stream.disconnected()
            return
        await self._resync()

    async def _resync(self) -> None:
        """After a (re)connect: replay from the last batch applied. If the publisher still has that very
        batch, it is the same stream and the rest is what was missed; if not, it is a new engine (or one
        that moved on too far): start over from its first batch."""
        stream = self.stream
        if not self.record.kv_events_replay_endpoint:
            return  # unknown until the next batch shows where the stream is
        last = stream.last
        replayed = await self._replay(0 if last is None else last)
        if last is not None:
            if replayed and replayed[0].sequence == last and stream.already_applied(replayed[0]):
                stream.idle_in_sync()
                replayed = replayed[1:]
            else:
                stream.restarted()
                replayed = await self._replay(0)
        if not replayed:
            stream.idle_in_sync()
        for frame in replayed:
            await self._handle(frame)

    async def _receive(self, parts: list[bytes]) -> None:
        try:
            frame = split_frames(parts)
        except KVEventDecodeError as error:
            log.warning("worker %s: %s", self.record.id, error)
            return
        await self._handle(frame)

    async def _handle(self, frame: Frame) -> None:
        stream = self.stream
        if stream.already_applied(frame):
            return  # replay and live delivery overlapped
        start = stream.replay_from(frame.sequence)
        if start is not None:
            stream.catch_up(start, frame.sequence, await self._replay(start, frame.sequence))
        stream.accept(frame)

    async def _replay(self, start: int, before: int | None = None) -> list[Frame]:
        endpoint = self.record.kv_events_replay_endpoint
        if not endpoint:
            return []
        frames = await fetch_replay(self._context, endpoint, start, self._replay_timeout_s)
        return frames if before is None else [f for f in frames if f.sequence < before]


class KVEventSubscriptions:
    def __init__(self, index: PrefixIndex, context: zmq.asyncio.Context | None = None,
                 clock: Callable[[], float] = time.monotonic, relearn_s: float = 30.0,
                 replay_timeout_s: float = 1.0) -> None:
        self.index = index
        self._context = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._relearn_s = relearn_s
        self._replay_timeout_s = replay_timeout_s
        self._running: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._running)

    def sync(self, records: Iterable[WorkerRecord]) -> None:
        wanted = {r.id: r for r in records if r.kv_events_endpoint and r.state in SERVING}
        for worker_id, (subscription, task) in list(self._running.items()):
            record = wanted.get(worker_id)
            if record is not None and _same_stream(subscription.record, record):
                continue
            task.cancel()
            del self._running[worker_id]
            self.index.forget(worker_id)
        for worker_id, record in wanted.items():
            if worker_id not in self._running:
                subscription = Subscription(record, self.index, self._context, self._clock, self._relearn_s,
                                            self._replay_timeout_s)
                task = asyncio.create_task(subscription.run(), name=f"kv-events-{worker_id}")
                task.add_done_callback(_log_failure)
                self._running[worker_id] = (subscription, task)

    async def follow(self, fleet: SnapshotSource, interval_s: float = FOLLOW_INTERVAL_S,
                     metrics: KvEventMetrics | None = None) -> None:
        """Keep the subscriptions equal to the fleet until cancelled (and the metrics current)."""
        seen: FleetSnapshot | None = None
        counted = (0, 0)
        try:
            while True:
                snapshot = fleet.snapshot
                if snapshot is not seen:
                    self.sync(snapshot.workers)
                    seen = snapshot
                if metrics is not None:
                    counted = self._report(metrics, counted)
                await asyncio.sleep(interval_s)
        finally:
            await self.close()

    def _report(self, metrics: KvEventMetrics, counted: tuple[int, int]) -> tuple[int, int]:
        known = sum(1 for worker_id in self._running if self.index.is_known(worker_id))
        metrics.kv_event_streams.labels("known").set(known)
        metrics.kv_event_streams.labels("unknown").set(len(self._running) - known)
        metrics.kv_index_blocks.set(self.index.stats().blocks)
        gaps = sum(s.stream.gaps for s, _ in self._running.values())
        lost = sum(s.stream.lost for s, _ in self._running.values())
        metrics.kv_event_gaps.labels("replayed").inc(max(0, (gaps - lost) - (counted[0] - counted[1])))
        metrics.kv_event_gaps.labels("lost").inc(max(0, lost - counted[1]))
        return gaps, lost

    async def close(self) -> None:
        tasks = [task for _, task in self._running.values()]
        self._running.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _same_stream(old: WorkerRecord, new: WorkerRecord) -> bool:
    return (old.kv_events_endpoint, old.kv_events_replay_endpoint, old.registered_at) == \
        (new.kv_events_endpoint, new.kv_events_replay_endpoint, new.registered_at)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("KV event subscription %s failed", task.get_name(), exc_info=task.exception())
