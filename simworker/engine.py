"""A pure model of one vLLM engine: FCFS continuous batching over a paged KV cache.

Each ``step(now)`` plans one iteration the way vLLM V1's scheduler does and returns how long the
GPU would take (``presets.StepCost``, with a small seeded jitter) and what happened. Nothing here
sleeps or reads a clock: the caller passes ``now`` and advances it by ``duration_s``, so tests drive
it with a virtual clock and the async driver with a real one.

One step:
1. Running sequences first, in admission order: a prefilling sequence gets the next chunk of its
   prompt (chunked prefill, bounded by ``max_num_batched_tokens``), a decoding one gets one token.
   If its KV needs a new block and none is free, the most recently admitted running sequence is
   preempted (recompute: blocks freed, put back at the front of the waiting queue) until it fits.
2. If nothing was preempted, waiting sequences are admitted in FCFS order while ``max_num_seqs``,
   the token budget and free blocks allow; the head of the queue blocks the rest. With prefix
   caching the cached leading blocks of the prompt are reused and not prefilled again.
   A prompt's full blocks enter the prefix cache as the step computing them is scheduled, as vLLM V1's
   ``KVCacheManager.allocate_slots`` caches up to the tokens it schedules: a question admitted in the same
   step as its document's first reader, or while that document is still being chunked, shares the blocks
   scheduled so far instead of computing them again.
   Prefix-cache statistics count as vLLM V1 counts them (``KVCacheManager.record_prefix_cache_stats``):
   at admission, in tokens (``queries`` = the request's tokens, ``hits`` = its cached tokens), and only
   for a request's first admission; a re-admission after preemption goes to V1's separate
   ``preempted_*`` stats, which the Prometheus counters leave out.
3. A sequence whose scheduled tokens reach its end samples one output token; it finishes when it
   reaches its output target ("length" if that is ``max_tokens``, "stop" if the model ends first).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from simworker.kv_cache import KVCache
from simworker.kv_events import KVEventSink
from simworker.presets import StepCost, attention_pairs, jittered

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class EngineConfig:
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    cost: StepCost
    step_jitter: float = 0.0
    """Relative standard deviation of each step's time (``presets.jittered``); 0 keeps the cost model exact."""
    seed: int = 0
    """Seeds the jitter, so one seed replays the same step times."""


@dataclass(frozen=True)
class EngineRequest:
    """What the engine needs to know about a request; the output target is decided by the caller."""

    request_id: str
    prompt_tokens: int
    output_target: int
    finish_reason_at_target: FinishReason
    prompt_block_hashes: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt's token ids, for the ``BlockStored`` events of its blocks (empty: events carry none)."""
    remote_computed_tokens: int = 0
    """Prompt tokens whose KV a producer computed and this (decode) worker read (``kv_transfer``): not
    prefilled at the first admission; after a preemption they are recomputed, as vLLM does."""


@dataclass(frozen=True)
class RequestFinished:
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    e2e_s: float


@dataclass(frozen=True)
class StepOutcome:
    """One step's effects; times are on the caller's clock, the step ends at ``start + duration_s``."""

    start: float
    duration_s: float
    scheduled_tokens: int
    context_tokens: int
    emitted: tuple[str, ...]
    queue_times: tuple[tuple[str, float], ...]
    first_token_times: tuple[tuple[str, float], ...]
    finished: tuple[RequestFinished, ...]
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def end(self) -> float:
        return self.start + self.duration_s


@dataclass(frozen=True)
class PrefixCacheReset:
    done: bool
    """False: some blocks were still held, and nothing was forgotten (vLLM logs a warning then)."""
    preemptions: int


@dataclass
class _Sequence:
    request: EngineRequest
    arrival_time: float
    computed_tokens: int = 0
    output_tokens: int = 0
    private_blocks: int = 0
    shared_hashes: list[int] = field(default_factory=list)
    scheduled_before: bool = False
    first_token_seen: bool = False

    @property
    def total_tokens(self) -> int:
        return self.request.prompt_tokens + self.output_tokens

    @property
    def blocks_held(self) -> int:
        return self.private_blocks + len(self.shared_hashes)


@dataclass
class _StepLog:
    emitted: list[str] = field(default_factory=list)
    queue_times: list[tuple[str, float]] = field(default_factory=list)
    first_token_times: list[tuple[str, float]] = field(default_factory=list)
    finished: list[RequestFinished] = field(default_factory=list)
    preemptions: int = 0
    prompt_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's leading blocks the prefix cache may serve: never the one holding its last token,
    which is computed again so the step has logits to sample the first output token from."""
    return (prompt_tokens - 1) // block_size


class Engine:
    def __init__(self, config: EngineConfig, kv_events: KVEventSink | None = None) -> None:
        if config.max_model_len > config.num_gpu_blocks * config.block_size:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache "
                f"({config.num_gpu_blocks} blocks x {config.block_size} tokens); lower --max-model-len")
        self.config = config
        self._rng = random.Random(config.seed)
        self.kv = KVCache(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching, kv_events)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._sequences: dict[str, _Sequence] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add_request(self, request: EngineRequest, now: float) -> None:
        if request.request_id in self._sequences:
            raise ValueError(f"duplicate request id {request.request_id}")
        if request.prompt_tokens <= 0 or request.output_target <= 0:
            raise ValueError("a request needs at least one prompt token and one output token")
        sequence = _Sequence(request=request, arrival_time=now)
        self._sequences[request.request_id] = sequence
        self._waiting.append(sequence)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it already finished."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return False
        if sequence in self._running:
            self._running.remove(sequence)
            self._free(sequence)
        else:
            self._waiting.remove(sequence)
        return True

    def leak_blocks(self, blocks: int) -> int:
        return self.kv.leak(blocks)

    def reset_prefix_cache(self, preempt_running: bool = False) -> PrefixCacheReset:
        """vLLM's ``reset_prefix_cache``, between two steps: forget every cached prefix.

        Refused while running sequences hold blocks, unless ``preempt_running``: then every running
        sequence is preempted first (last admitted first, so the waiting queue keeps their order) and
        will recompute from scratch, as vLLM's ``reset_running_requests=True`` does.
        """
        preempted = 0
        if preempt_running:
            while self._running:
                victim = self._running.pop()
                self._free(victim)
                self._requeue(victim)
                preempted += 1
        return PrefixCacheReset(done=self.kv.reset_prefix_cache(), preemptions=preempted)

    def step(self, now: float) -> StepOutcome:
        log = _StepLog()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Sequence, int]] = []
        budget = self._schedule_running(scheduled, budget, now, log)
        if log.preemptions == 0:
            self._admit_waiting(scheduled, budget, now, log)
        scheduled_tokens = sum(tokens for _, tokens in scheduled)
        context_tokens = sum(sequence.computed_tokens for sequence, _ in scheduled)
        pairs = sum(attention_pairs(sequence.computed_tokens, tokens) for sequence, tokens in scheduled)
        duration = jittered(self.config.cost.step_seconds(scheduled_tokens, context_tokens, pairs),
                            self.config.step_jitter, self._rng)
        self._apply(scheduled, now + duration, log)
        return StepOutcome(
            start=now, duration_s=duration, scheduled_tokens=scheduled_tokens,
            context_tokens=context_tokens, emitted=tuple(log.emitted), queue_times=tuple(log.queue_times),
            first_token_times=tuple(log.first_token_times), finished=tuple(log.finished),
            preemptions=log.preemptions, prompt_tokens=log.prompt_tokens,
            generation_tokens=len(log.emitted), prefix_cache_queries=log.prefix_cache_queries,
            prefix_cache_hits=log.prefix_cache_hits,
        )

    def _schedule_running(self, scheduled: list[tuple[_Sequence, int]], budget: int, now: float,
                          log: _StepLog) -> int:
        index = 0
        while index < len(self._running) and budget > 0:
            sequence = self._running[index]
            tokens = min(sequence.total_tokens - sequence.computed_tokens, budget)
            needed = self.kv.blocks_for(sequence.computed_tokens + tokens) - sequence.blocks_held
            while needed > self.kv.free_blocks:
                victim = self._running.pop()
                self._free(victim)
                if victim is sequence and not self._running:
                    self._finish(victim, "error", now, log)
                    break
                self._requeue(victim)
                log.preemptions += 1
                if victim is sequence:
                    break
            else:
                self.kv.allocate(needed)
                sequence.private_blocks += needed
                scheduled.append((sequence, tokens))
                self._publish_prompt_blocks(sequence, sequence.computed_tokens + tokens)
                budget -= tokens
                index += 1
                continue
            break
        return budget

    def _admit_waiting(self, scheduled: list[tuple[_Sequence, int]], budget: int, now: float,
                       log: _StepLog) -> None:
        block_size = self.config.block_size
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            sequence = self._waiting[0]
            reusable = sequence.request.prompt_block_hashes[:reusable_blocks(sequence.total_tokens, block_size)]
            hit_blocks = self.kv.cached_prefix_blocks(reusable)
            hit_hashes = reusable[:hit_blocks]
            local_hits = computed = hit_blocks * block_size
            if not sequence.scheduled_before:
                computed = max(computed, sequence.request.remote_computed_tokens)
            tokens = min(sequence.total_tokens - computed, budget)
            needed = self.kv.blocks_for(computed + tokens) - hit_blocks
            if needed > self.kv.free_blocks - self.kv.evictable_among(hit_hashes):
                if not self._running and needed > self.kv.num_blocks - self.kv.leaked_blocks:
                    self._waiting.popleft()
                    self._finish(sequence, "error", now, log)
                    continue
                break
            self._waiting.popleft()
            self.kv.acquire_shared(hit_hashes)
            self.kv.allocate(needed)
            sequence.shared_hashes = list(hit_hashes)
            sequence.private_blocks = needed
            sequence.computed_tokens = computed
            if not sequence.scheduled_before:
                if self.config.enable_prefix_caching:
                    log.prefix_cache_queries += sequence.total_tokens
                    log.prefix_cache_hits += local_hits  # vLLM counts a connector's tokens apart
                sequence.scheduled_before = True
                log.queue_times.append((sequence.request.request_id, now - sequence.arrival_time))
            self._running.append(sequence)
            scheduled.append((sequence, tokens))
            self._publish_prompt_blocks(sequence, sequence.computed_tokens + tokens)
            budget -= tokens

    def _apply(self, scheduled: list[tuple[_Sequence, int]], end: float, log: _StepLog) -> None:
        for sequence, tokens in scheduled:
            sequence.computed_tokens += tokens
            if sequence.computed_tokens < sequence.total_tokens:
                continue
            sequence.output_tokens += 1
            request_id = sequence.request.request_id
            log.emitted.append(request_id)
            if not sequence.first_token_seen:
                sequence.first_token_seen = True
                log.first_token_times.append((request_id, end - sequence.arrival_time))
                log.prompt_tokens += sequence.request.prompt_tokens
            if sequence.output_tokens >= sequence.request.output_target:
                self._running.remove(sequence)
                self._free(sequence)
                self._finish(sequence, sequence.request.finish_reason_at_target, end, log)

    def _publish_prompt_blocks(self, sequence: _Sequence, scheduled_upto: int) -> None:
        """Enter the prompt's full blocks up to ``scheduled_upto`` tokens into the prefix cache (called as their step
        is scheduled: the module docstring, 2). Sharing a block that this very step computes is sound: in one
        forward pass every layer writes the batch's KV before its attention reads it."""
        if not self.config.enable_prefix_caching:
            return
        hashes = sequence.request.prompt_block_hashes
        token_ids = sequence.request.prompt_token_ids
        block_size = self.config.block_size
        full_blocks = min(scheduled_upto // block_size, len(hashes))
        while len(sequence.shared_hashes) < full_blocks:
            index = len(sequence.shared_hashes)
            block_hash = hashes[index]
            self.kv.share_private_block(block_hash, hashes[index - 1] if index else None,
                                        token_ids[index * block_size:(index + 1) * block_size])
            sequence.private_blocks -= 1
            sequence.shared_hashes.append(block_hash)

    def _requeue(self, sequence: _Sequence) -> None:
        """Preemption by recompute: the sequence's KV is gone; it waits at the head of the queue."""
        sequence.computed_tokens = 0
        self._waiting.appendleft(sequence)

    def _free(self, sequence: _Sequence) -> None:
        self.kv.release(sequence.private_blocks, sequence.shared_hashes)
        sequence.private_blocks = 0
        sequence.shared_hashes = []

    def _finish(self, sequence: _Sequence, reason: FinishReason, now: float, log: _StepLog) -> None:
        self._sequences.pop(sequence.request.request_id, None)
        log.finished.append(RequestFinished(
            request_id=sequence.request.request_id, reason=reason,
            prompt_tokens=sequence.request.prompt_tokens, output_tokens=sequence.output_tokens,
            e2e_s=now - sequence.arrival_time,
        ))
