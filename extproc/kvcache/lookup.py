"""From a request body to what the scheduler needs: the prompt's block keys, and the index's answers.

``prepare`` tokenises the prompt with the served model's tokenizer (the pool's configured one, else the
simulator's for simulated workers, else none: the scheduler estimates) and computes its block keys for
every block size among the model's publishing workers; its token count replaces the prompt estimate
(``place``). Bodies longer than ``inline_bytes`` are tokenised in a worker thread, so the event loop never
stalls on a long prompt. ``placed`` marks the prompt's blocks pending on the chosen worker; ``cached_tokens``
is the view picks read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import orjson

from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.tokenizer import PromptTokenizer, SimTokenizer, prompt_token_ids
from extproc.scheduling.plugins import PickRequest
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.fleet import WorkerRecord

log = logging.getLogger(__name__)

INLINE_BYTES = 2048
"""Below this a body is tokenised on the loop (~0.1 ms with the simulated tokenizer); above, in a thread."""
SIMULATED_BACKEND = "sim"


class CacheLookup:
    def __init__(self, index: PrefixIndex, snapshot: Callable[[], FleetSnapshot],
                 pool_tokenizers: Mapping[str, PromptTokenizer] | None = None, inline_bytes: int = INLINE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._snapshot = snapshot
        self._pool_tokenizers = dict(pool_tokenizers or {})
        self._sim = SimTokenizer()
        self._inline_bytes = inline_bytes
        self._clock = clock

    def wants(self, request: PickRequest) -> bool:
        """Worth tokenising: some worker of the model publishes its cache and we know how to tokenise."""
        return self._plan(request) is not None

    async def prepare(self, request: PickRequest, body: bytes) -> PickRequest:
        plan = self._plan(request)
        if plan is None:
            return request
        tokenizer, block_sizes = plan
        if len(body) > self._inline_bytes:
            blocks = await asyncio.to_thread(_prompt_blocks, body, tokenizer, block_sizes, request.adapter)
        else:
            blocks = _prompt_blocks(body, tokenizer, block_sizes, request.adapter)
        return request if blocks is None else replace(request, prompt_blocks=blocks)

    def placed(self, worker: WorkerRecord, request: PickRequest) -> PlacedPrompt | None:
        """Mark the prompt's blocks pending on the worker, and say what the index held for it there just before,
        from the one walk the marking needs anyway (None: the request has no blocks)."""
        blocks = request.prompt_blocks
        if blocks is None:
            return None
        block_size = self._block_size(worker)
        keys = blocks.keys.get(block_size)
        if not keys:
            return PlacedPrompt((), 0, blocks.token_count, 0, 0)
        now = self._clock()
        worker_id = worker.id
        held, held_or_pending = self.index.cached_prefixes(keys, (worker_id,), now)
        self.index.add_pending(worker_id, keys, now)
        most = _most_reusable(blocks)
        counted = held_or_pending.get(worker_id, 0)
        return PlacedPrompt(keys, counted, blocks.token_count, min(held.get(worker_id, 0) * block_size, most),
                            min(counted * block_size, most))

    def placed_elsewhere(self, worker_id: str, keys: Sequence[int]) -> None:
        """Another replica placed a prompt with these block keys on the worker (a sibling process's datagram,
        or the peer exchange's stream for a replica on another host)."""
        if keys:
            self.index.add_pending(worker_id, keys, self._clock())

    def cached_tokens(self, blocks: PromptBlocks, candidates: Sequence[WorkerRecord],
                      pending: bool = True) -> Mapping[str, int]:
        answer = self.answer(blocks, candidates)
        return answer.with_pending if pending else answer.confirmed

    def for_pick(self) -> PickLookup:
        """The view one pick reads: it asks about the same prompt up to three times (the KV filter, the
        backlog gate, the latency), and the index cannot change within a pick (nothing awaits), so the
        first answer serves them all."""
        return PickLookup(self)

    def answer(self, blocks: PromptBlocks, candidates: Sequence[WorkerRecord]) -> CachedPrefixes:
        """Both answers (confirmed blocks only, and with pending ones) for the known workers among
        ``candidates``, from one walk of the index per block size."""
        now = self._clock()
        sizes = self.index.block_sizes.get
        by_size: dict[int, list[str]] = {}
        asked = []
        for worker in candidates:
            worker_id = worker.id
            asked.append(worker_id)
            size = sizes(worker_id) or worker.kv_block_size  # _block_size, inlined: this loop is the pick's
            group = by_size.get(size)
            if group is None:
                by_size[size] = [worker_id]
            else:
                group.append(worker_id)
        confirmed: dict[str, int] = {}
        with_pending: dict[str, int] = {}
        most = _most_reusable(blocks)
        for block_size, worker_ids in by_size.items():
            keys = blocks.keys.get(block_size)
            if keys is None:
                continue
            held, held_or_pending = self.index.cached_prefixes(keys, worker_ids, now)
            for answer, depths in ((confirmed, held), (with_pending, held_or_pending)):
                for worker_id, depth in depths.items():
                    tokens = depth * block_size
                    answer[worker_id] = tokens if tokens < most else most
        return CachedPrefixes(blocks, frozenset(asked), confirmed, with_pending)

    def held_tokens(self, worker: WorkerRecord) -> int | None:
        return self.index.held_tokens(worker.id)

    def _block_size(self, worker: WorkerRecord) -> int:
        return self.index.block_sizes.get(worker.id) or worker.kv_block_size

    def _plan(self, request: PickRequest) -> tuple[PromptTokenizer, tuple[int, ...]] | None:
        """The tokenizer and the publishing workers' block sizes. A pool with a configured tokenizer is always
        tokenised (its exact count replaces the estimate, even where no worker publishes); the simulator's
        only for simulated workers that publish."""
        workers = self._snapshot().workers_for(request.model)
        publishing = [w for w in workers if w.kv_events_endpoint]
        tokenizers = self._pool_tokenizers
        tokenizer = next((tokenizers[w.pool] for w in workers if w.pool in tokenizers), None) if tokenizers else None
        if tokenizer is None and any(w.backend == SIMULATED_BACKEND for w in publishing):
            tokenizer = self._sim
        if tokenizer is None:
            return None
        return tokenizer, tuple(sorted({self._block_size(w) for w in publishing}))


def _prompt_blocks(body: bytes, tokenizer: PromptTokenizer, block_sizes: tuple[int, ...],
                   adapter: str | None) -> PromptBlocks | None:
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        token_ids = prompt_token_ids(data, tokenizer)
    except Exception:  # a tokenizer library failing on odd text must not fail the request
        log.exception("tokenising a prompt failed; the scheduler estimates for it")
        return None
    if token_ids is None:
        return None
    return PromptBlocks(len(token_ids), {size: prompt_keys(token_ids, size, adapter) for size in block_sizes})


def _most_reusable(blocks: PromptBlocks) -> int:
    """The most of a prompt a worker's cache can spare it: all but the last token, which the engine computes
    again for the first output token even when every block is cached."""
    return max(0, blocks.token_count - 1)


class PlacedPrompt(NamedTuple):
    """A prompt just marked pending on a worker, and what the index counted for it there before."""

    keys: Sequence[int]
    """Its block keys at the worker's block size (for the sibling processes)."""
    counted: int
    """How many of the first keys the index already counted there, held or pending: the others are news to the
    replicas on other hosts (``placed_prefixes``)."""
    prompt_tokens: int
    """The prompt's tokens as the engine counts them."""
    held_tokens: int
    """Tokens of its prefix the worker's events had confirmed (what its cache holds now)."""
    held_or_pending_tokens: int
    """The same with the blocks pending there (placed and not yet confirmed): what the engine will have
    computed by the time it admits this request."""


@dataclass(frozen=True, slots=True)
class CachedPrefixes:
    """One lookup of a prompt against the index, both ways, for the workers asked about."""

    blocks: PromptBlocks
    asked: frozenset[str]
    confirmed: dict[str, int]
    with_pending: dict[str, int]


class PickLookup:
    """``CacheLookup`` as one pick reads it: the answer for a prompt is worked out once and then read for any
    of the workers it was asked about (a filter's survivors are among them)."""

    __slots__ = ("_index", "_last", "_lookup")

    def __init__(self, lookup: CacheLookup) -> None:
        self._lookup = lookup
        self._index = lookup.index
        self._last: CachedPrefixes | None = None

    def cached_tokens(self, blocks: PromptBlocks, candidates: Sequence[WorkerRecord],
                      pending: bool = True) -> Mapping[str, int]:
        last = self._last
        if last is None or last.blocks is not blocks or not all(w.id in last.asked for w in candidates):
            last = self._last = self._lookup.answer(blocks, candidates)
        asked = last.asked
        answer = last.with_pending if pending else last.confirmed
        if len(candidates) == len(asked):  # the same workers (all of them were asked): the answer as it is
            return answer
        return {w.id: answer[w.id] for w in candidates if w.id in answer}

    def held_tokens(self, worker: WorkerRecord) -> int | None:
        return self._index.held_tokens(worker.id)
