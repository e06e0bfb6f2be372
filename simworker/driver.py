"""Runs an ``Engine`` in real time: one step, sleep for its modelled duration, hand out tokens.

Handlers ``submit`` a request and read its ``TokenStream``; the driver wakes them when tokens or the
finish arrive. ``time_scale`` > 1 runs the model faster than real time; the engine itself sees model
time, and its vLLM metrics are reported in real seconds (``WorkerMetrics``), as an engine running at that
speed would report them to a router that reads them against its own clock.

Drift: a step's tokens should appear exactly ``duration / time_scale`` after the step began. If the
process is too busy (many workers, many streams, a slow host) they appear late; that lateness is the
``poolgate_sim_step_lag_seconds`` histogram. The next step starts when the late one ended (no catch
up), so lag lowers throughput the way a slow host would, rather than bursting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from simworker.engine import Engine, EngineRequest, RequestFinished, StepOutcome
from simworker.metrics import WorkerMetrics

UTILIZATION_WINDOW_S = 1.0


@dataclass
class TokenStream:
    """Tokens generated so far for one request and, once it is over, how it ended."""

    request_id: str
    tokens: int = 0
    finished: RequestFinished | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_change(self) -> None:
        await self.changed.wait()
        self.changed.clear()


class EngineDriver:
    def __init__(self, engine: Engine, metrics: WorkerMetrics, *, time_scale: float = 1.0,
                 weight_bytes: float = 0.0, kv_block_bytes: float = 0.0,
                 flush_kv_events: Callable[[], None] | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.metrics = metrics
        self.time_scale = time_scale
        self._weight_bytes = weight_bytes
        self._kv_block_bytes = kv_block_bytes
        self._streams: dict[str, TokenStream] = {}
        self._work = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()
        self._busy: deque[tuple[float, float]] = deque()
        self._dead = False
        self._flush_kv_events = flush_kv_events
        """Publishes what the cache recorded; called whenever the engine may have changed (``_publish_state``),
        but never while a step runs: the engine records a step's blocks as it schedules them, and vLLM publishes
        a step's events once the step is done."""
        self._step_in_flight = False
        metrics.track_utilization(self.utilization)
        self._publish_state()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def model_now(self) -> float:
        return (self._loop.time() - self._origin) * self.time_scale

    def submit(self, request: EngineRequest) -> TokenStream:
        if self._dead:
            raise RuntimeError("engine is dead")
        stream = TokenStream(request.request_id)
        self.engine.add_request(request, self.model_now())
        self._streams[request.request_id] = stream
        self._work.set()
        self._publish_state()
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: free the sequence's KV now."""
        if self._streams.pop(request_id, None) is None:
            return
        if self.engine.abort(request_id):
            self.metrics.success["abort"].inc()
        self._publish_state()

    def leak_blocks(self, blocks: int) -> None:
        self.engine.leak_blocks(blocks)
        self._work.set()  # a running sequence may now need preempting
        self._publish_state()

    def reset_prefix_cache(self, preempt_running: bool) -> bool:
        """Runs between two steps (the engine only changes inside ``step``); False if it was refused."""
        outcome = self.engine.reset_prefix_cache(preempt_running)
        if outcome.preemptions:
            self.metrics.preemptions.inc(outcome.preemptions)
            self._work.set()
        self._publish_state()
        return outcome.done

    def kill(self) -> None:
        """The engine died: every open stream ends with an error and nothing new is accepted."""
        self._dead = True
        for stream in self._streams.values():
            stream.finished = RequestFinished(stream.request_id, "error", 0, stream.tokens, 0.0)
            stream.changed.set()
        self._streams.clear()
        self._work.set()

    def utilization(self) -> float:
        now = self._loop.time()
        window_start = now - UTILIZATION_WINDOW_S
        busy = sum(max(0.0, min(end, now) - max(start, window_start)) for start, end in self._busy)
        return min(1.0, busy / UTILIZATION_WINDOW_S)

    async def run(self) -> None:
        loop = self._loop
        while not self._dead:
            if not self.engine.has_work:
                self._work.clear()
                await self._work.wait()
                continue
            started = loop.time()
            self._step_in_flight = True
            outcome = self.engine.step(self.model_now())
            intended_end = started + outcome.duration_s / self.time_scale
            await asyncio.sleep(max(0.0, intended_end - loop.time()))
            if self._dead:
                return
            ended = loop.time()
            self.metrics.step_lag.observe(max(0.0, ended - intended_end))
            self.metrics.modelled_step_seconds.inc(intended_end - started)
            self._note_busy(started, intended_end)
            self._deliver(outcome, ended - started)

    def _deliver(self, outcome: StepOutcome, real_step_s: float) -> None:
        self._step_in_flight = False
        self.metrics.record_step(outcome, real_step_s)
        streams = self._streams
        for request_id in outcome.emitted:
            stream = streams.get(request_id)
            if stream is not None:
                stream.tokens += 1
                stream.changed.set()
        for finished in outcome.finished:
            stream = streams.pop(finished.request_id, None)
            if stream is not None:
                stream.finished = finished
                stream.changed.set()
        self._publish_state()

    def _note_busy(self, start: float, end: float) -> None:
        self._busy.append((start, end))
        while self._busy and self._busy[0][1] < end - UTILIZATION_WINDOW_S:
            self._busy.popleft()

    def _publish_state(self) -> None:
        if self._flush_kv_events is not None and not self._step_in_flight:
            self._flush_kv_events()
        kv = self.engine.kv
        self.metrics.record_state(
            running=self.engine.num_running, waiting=self.engine.num_waiting, kv_usage=kv.usage,
            gpu_memory_used_bytes=self._weight_bytes + kv.used_blocks * self._kv_block_bytes,
            leaked_blocks=kv.leaked_blocks,
        )
