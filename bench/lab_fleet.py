"""The lab's fleet: simulated vLLM engines on virtual time, in one process, with no sockets.

Each worker is simworker's own engine model (``simworker.engine.Engine``: continuous batching, chunked
prefill, paged KV with prefix caching, preemption) with the preset's step-time model, so a routing policy
meets the same queueing a simulated worker over HTTP would give it, minus the host's noise. What the fleet
publishes is what the real parts publish:

- after each engine step, the KV-cache events of that step, encoded as vLLM puts them on the wire
  (``simworker.kv_events.encode_batch``) and decoded by extproc's own decoder (``extproc.kvcache.wire``),
  delivered ``EVENT_DELAY_S`` after the step ends;
- every ``SCRAPE_INTERVAL_S``, the worker records an agent would write (KV usage, running, waiting, the
  prefill rate as prompt tokens per second of prefill time, as ``agent.rates`` derives it);
- per request: the first token (the response's first byte) and the end, at the step that produced them.

Time is a float of model seconds; ``VirtualLoop`` runs callbacks in time order (ties in scheduling order),
so one seed replays exactly.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.rates import DEFAULT_ALPHA, ewma
from extproc.kvcache.wire import EventBatch, decode_batch
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from simworker.engine import Engine, EngineConfig, EngineRequest, StepOutcome
from simworker.kv_events import KVEventRecorder, encode_batch
from simworker.presets import PRESETS, STEP_JITTER, ModelShape, default_num_gpu_blocks, step_cost

SCRAPE_INTERVAL_S = 0.25
"""The agent's default scrape interval."""
EVENT_DELAY_S = 0.002
"""From the end of a step to the router's index: the ZMQ hop and the subscriber's decode."""
IDLE_RETRY_S = 0.001
"""A worker with work but nothing it can schedule (KV full behind the queue's head) tries again this soon."""
START_TIME = 1_000_000.0
"""Virtual wall-clock start: records stamped 0 mean "never" to the router, so the lab starts far from it."""
BLOCK_SIZE = 16


class VirtualLoop:
    """Callbacks at model times, in order; ``run_until`` advances ``now`` from one to the next."""

    def __init__(self, start: float = START_TIME) -> None:
        self.now = start
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), callback))

    def run_until(self, done: Callable[[], bool], limit: float) -> None:
        queue = self._queue
        while queue and not done():
            when, _, callback = heapq.heappop(queue)
            if when > limit:
                heapq.heappush(queue, (when, 0, callback))
                return
            self.now = when
            callback()


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    id: str
    pool: str
    model: str
    preset: str
    max_model_len: int


@dataclass
class _Rates:
    """The agent's rates, from the counters it reads (``agent.rates``): prompt tokens less prefix-cache hits
    per second of the requests' prefill phase (first scheduled to first token), the hit rate, and the mean
    time to first token and between a stream's tokens."""

    prompt_tokens: float = 0.0
    cache_hits: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    queries: float = 0.0
    prefix_cache_hit_rate: float = -1.0
    queued_for: dict[str, float] = field(default_factory=dict)
    ttft_seconds: float = 0.0
    first_tokens: int = 0
    ttft_ewma_s: float = -1.0
    gap_seconds: float = 0.0
    gaps: int = 0
    inter_token_s: float = -1.0


class LabWorker:
    """One engine and what the outside world sees of it."""

    def __init__(self, plan: WorkerPlan, seed: int) -> None:
        preset = PRESETS[plan.preset]
        model = ModelShape()
        self.plan = plan
        self.recorder = KVEventRecorder(BLOCK_SIZE)
        self.config = EngineConfig(
            num_gpu_blocks=default_num_gpu_blocks(preset, model, BLOCK_SIZE), block_size=BLOCK_SIZE,
            max_num_seqs=preset.max_num_seqs, max_num_batched_tokens=preset.max_num_batched_tokens,
            max_model_len=plan.max_model_len, enable_prefix_caching=True, cost=step_cost(preset, model),
            step_jitter=STEP_JITTER, seed=seed)
        self.engine = Engine(self.config, self.recorder)
        self.stepping = False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0
        """Sequences the engine preempted (their KV freed, to be computed again): a router that promised room
        the streams then needed."""
        self._rates = _Rates()

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def kv_capacity_tokens(self) -> int:
        return self.config.num_gpu_blocks * self.config.block_size

    def record(self, now: float) -> WorkerRecord:
        """What the agent would write for this worker now."""
        rates = self._rates
        computed = rates.prompt_tokens - rates.cache_hits
        if rates.prefill_seconds > 0 and computed > 0:
            rates.prefill_tokens_per_s = ewma(rates.prefill_tokens_per_s, computed / rates.prefill_seconds,
                                              DEFAULT_ALPHA, unknown=0.0)
        if rates.queries > 0:
            rates.prefix_cache_hit_rate = ewma(rates.prefix_cache_hit_rate, min(1.0, rates.cache_hits / rates.queries),
                                               DEFAULT_ALPHA, unknown=-1.0)
        if rates.first_tokens:
            rates.ttft_ewma_s = ewma(rates.ttft_ewma_s, rates.ttft_seconds / rates.first_tokens, DEFAULT_ALPHA,
                                     unknown=-1.0)
        if rates.gaps:
            rates.inter_token_s = ewma(rates.inter_token_s, rates.gap_seconds / rates.gaps, DEFAULT_ALPHA, unknown=-1.0)
        rates.prompt_tokens = rates.prefill_seconds = rates.queries = rates.cache_hits = 0.0
        rates.ttft_seconds = rates.gap_seconds = 0.0
        rates.first_tokens = rates.gaps = 0
        kv = self.engine.kv
        return WorkerRecord(
            id=self.plan.id, pool=self.plan.pool, model=self.plan.model, host="10.0.0.1",
            port=8000 + int(self.plan.id.rsplit("-", 1)[-1]), max_model_len=self.plan.max_model_len,
            state=WorkerState.READY, kv_capacity_tokens=self.kv_capacity_tokens, kv_block_size=BLOCK_SIZE,
            kv_usage=1.0 - kv.free_blocks / kv.num_blocks if kv.num_blocks else 0.0,
            running=self.engine.num_running, waiting=self.engine.num_waiting,
            ttft_ewma_s=rates.ttft_ewma_s, prefill_tokens_per_s=rates.prefill_tokens_per_s,
            inter_token_s=rates.inter_token_s, prefix_cache_hit_rate=rates.prefix_cache_hit_rate,
            updated_at=now, metrics_at=now,
            registered_at=START_TIME, kv_events_endpoint=f"ipc://lab/{self.plan.id}")

    def note_step(self, outcome: StepOutcome) -> None:
        self.preemptions += outcome.preemptions
        self.prefix_cache_queries += outcome.prefix_cache_queries
        self.prefix_cache_hits += outcome.prefix_cache_hits
        rates = self._rates
        rates.cache_hits += outcome.prefix_cache_hits
        rates.queries += outcome.prefix_cache_queries
        rates.prompt_tokens += outcome.prompt_tokens
        for request_id, queue_s in outcome.queue_times:
            rates.queued_for[request_id] = queue_s
        for request_id, ttft_s in outcome.first_token_times:
            rates.prefill_seconds += max(0.0, ttft_s - rates.queued_for.pop(request_id, 0.0))
            rates.ttft_seconds += ttft_s
        rates.first_tokens += len(outcome.first_token_times)
        later_tokens = len(outcome.emitted) - len(outcome.first_token_times)  # as vLLM's histogram counts them
        rates.gaps += later_tokens
        rates.gap_seconds += later_tokens * outcome.duration_s

    def take_events(self, now: float) -> EventBatch | None:
        """This step's KV events through the wire format: encoded as vLLM does, decoded as extproc does."""
        events = self.recorder.take()
        if not events:
            return None
        return decode_batch(encode_batch(events, ts=now))


StepListener = Callable[[LabWorker, StepOutcome], None]
EventListener = Callable[[str, EventBatch], None]


@dataclass
class LabFleet:
    """The workers, stepping on the loop; the listeners see each step's outcome and each event batch."""

    loop: VirtualLoop
    workers: dict[str, LabWorker]
    on_step: StepListener
    on_events: EventListener
    by_model: dict[str, list[LabWorker]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for worker in self.workers.values():
            self.by_model.setdefault(worker.plan.model, []).append(worker)

    def submit(self, worker_id: str, request: EngineRequest) -> None:
        worker = self.workers[worker_id]
        worker.engine.add_request(request, self.loop.now)
        if not worker.stepping:
            worker.stepping = True
            self.loop.at(self.loop.now, lambda: self._step(worker))

    def records(self) -> list[WorkerRecord]:
        now = self.loop.now
        return [worker.record(now) for worker in self.workers.values()]

    def _step(self, worker: LabWorker) -> None:
        engine = worker.engine
        if not engine.has_work:
            worker.stepping = False
            return
        outcome = engine.step(self.loop.now)
        worker.note_step(outcome)
        if outcome.scheduled_tokens == 0 and not outcome.finished:
            self.loop.at(self.loop.now + IDLE_RETRY_S, lambda: self._step(worker))
            return
        self.loop.at(outcome.end, lambda: self._step_done(worker, outcome))

    def _step_done(self, worker: LabWorker, outcome: StepOutcome) -> None:
        self.on_step(worker, outcome)
        batch = worker.take_events(self.loop.now)
        if batch is not None:
            self.loop.at(self.loop.now + EVENT_DELAY_S, lambda: self.on_events(worker.id, batch))
        self._step(worker)

