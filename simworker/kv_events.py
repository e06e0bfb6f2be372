"""vLLM's KV-cache events, as the simulated engine records them and vLLM puts them on the wire.

vLLM's block pool records an event when it really changes what the cache holds: ``BlockStored`` when
full blocks get a hash (one event per run of consecutive new blocks, with the hash of the block before
the run and the run's token ids), ``BlockRemoved`` when an allocation evicts a cached block, and
``AllBlocksCleared`` when the prefix cache is reset. The scheduler takes the recorded events after each
step and publishes them as one ``KVEventBatch``.

Wire shape (``vllm/distributed/kv_events.py`` of current releases, msgspec msgpack, ``omit_defaults``):
names and field orders in ``poolgate.kernel.kv_event_shapes``, shared with the router's decoder.
The batch is an array ``[ts, events, data_parallel_rank]``; each event is a map tagged by its class name
under ``"type"``, e.g. ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
"token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
"extra_keys": [None, ...], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}``. Fields whose value is
their default (``kv_cache_spec_sliding_window``) are left out, as ``omit_defaults`` leaves them out.
Releases before the change to maps sent each event as an array ``[tag, field, ...]``; the router's
decoder reads both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from poolgate.kernel.kv_event_shapes import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED,
    BLOCK_STORED_FIELDS,
    FULL_ATTENTION,
    KV_CACHE_SPEC_KIND,
    MEDIUM_GPU,
    TAG_KEY,
)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    """Where the KV cache reports what it really stores, evicts and resets."""

    def block_stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None: ...

    def block_removed(self, block_hash: int) -> None: ...

    def all_cleared(self) -> None: ...


class KVEventRecorder:
    """Collects one step's events; consecutive stores that chain (each block's parent is the block
    stored just before) merge into one ``BlockStored``, as vLLM stores a run of new blocks at once."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._run_hashes: list[int] = []
        self._run_tokens: list[int] = []
        self._run_parent: int | None = None

    def block_stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        if not self._run_hashes or parent_hash != self._run_hashes[-1]:
            self._close_run()
            self._run_parent = parent_hash
        self._run_hashes.append(block_hash)
        self._run_tokens.extend(token_ids)

    def block_removed(self, block_hash: int) -> None:
        self._close_run()
        if self._events and isinstance(self._events[-1], BlockRemoved):
            previous = self._events[-1]
            self._events[-1] = BlockRemoved((*previous.block_hashes, block_hash))
        else:
            self._events.append(BlockRemoved((block_hash,)))

    def all_cleared(self) -> None:
        self._close_run()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        self._close_run()
        events, self._events = self._events, []
        return events

    def _close_run(self) -> None:
        if self._run_hashes:
            self._events.append(BlockStored(tuple(self._run_hashes), self._run_parent, tuple(self._run_tokens),
                                            self.block_size))
            self._run_hashes, self._run_tokens = [], []


def event_wire_form(event: KVEvent) -> dict[str, object]:
    """One event as current vLLM releases encode it: a map tagged ``type``, defaults left out."""
    if isinstance(event, BlockStored):
        stored: tuple[object, ...] = (
            list(event.block_hashes), event.parent_block_hash, list(event.token_ids), event.block_size, None,
            MEDIUM_GPU, event.lora_name, [None] * len(event.block_hashes), 0)
        return {TAG_KEY: BLOCK_STORED, **dict(zip(BLOCK_STORED_FIELDS, stored, strict=True)),
                KV_CACHE_SPEC_KIND: FULL_ATTENTION}
    if isinstance(event, BlockRemoved):
        removed: tuple[object, ...] = (list(event.block_hashes), MEDIUM_GPU, 0)
        return {TAG_KEY: BLOCK_REMOVED, **dict(zip(BLOCK_REMOVED_FIELDS, removed, strict=True))}
    return {TAG_KEY: ALL_BLOCKS_CLEARED}


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[KVEvent], data_parallel_rank: int = 0, ts: float | None = None) -> bytes:
    """A ``KVEventBatch`` payload: ``[ts, [event, ...], data_parallel_rank]`` in msgpack."""
    stamp = time.time() if ts is None else ts
    return _encoder.encode([stamp, [event_wire_form(event) for event in events], data_parallel_rank])
