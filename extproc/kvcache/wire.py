"""Decode vLLM's KV-event messages: the ZMQ frames and the msgpack ``KVEventBatch`` they carry.

Accepted shapes (``vllm/distributed/kv_events.py``; msgspec's tagged structs with ``omit_defaults``; tags
and field orders declared once in ``poolgate.kernel.kv_event_shapes``, which the simulator encodes with):

- batch: an array ``[ts, events]`` or ``[ts, events, data_parallel_rank]``, or a map with those keys;
- event: a map tagged ``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...fields}`` (current
  releases), or an array ``[tag, field, ...]`` in declaration order (releases before the change to maps):
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)``,
  ``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared()``. Missing trailing fields read as
  ``None``; unknown fields and unknown event tags are skipped (a newer engine must not break the router).

Engine block hashes are opaque (64-bit integers, or bytes with some hash algorithms); the router never
interprets them, it only maps them to keys of its own (``keys``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from poolgate.kernel.errors import UpstreamError
from poolgate.kernel.kv_event_shapes import (
    ALL_BLOCKS_CLEARED,
    BATCH_FIELDS,
    BLOCK_REMOVED,
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED,
    BLOCK_STORED_FIELDS,
    TAG_KEY,
)

EngineHash = int | bytes


class KVEventDecodeError(UpstreamError, ValueError):
    """A message that is not a KV-event batch: the stream is treated as broken, never guessed at."""


@dataclass(frozen=True, slots=True)
class Stored:
    engine_hashes: tuple[EngineHash, ...]
    parent_engine_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    engine_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    """One message off the PUB socket (or a replay reply): its sequence number and payload."""

    sequence: int
    payload: bytes


_decoder = msgspec.msgpack.Decoder()


def split_frames(frames: Sequence[bytes]) -> Frame:
    """``(topic, sequence, payload)`` from the PUB socket, or ``(sequence, payload)`` from a replay."""
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != 8:
        raise KVEventDecodeError(f"expected (topic, 8-byte sequence, payload), got {len(frames)} frames")
    return Frame(int.from_bytes(frames[0], "big", signed=True), bytes(frames[1]))


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise KVEventDecodeError(f"not msgpack: {error}") from error
    if isinstance(raw, Mapping):
        raw = [raw.get(name) for name in BATCH_FIELDS]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[0], int | float) \
            or not isinstance(raw[1], list):
        raise KVEventDecodeError("a KVEventBatch is [ts, events, data_parallel_rank]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = tuple(event for event in (_event(item) for item in raw[1]) if event is not None)
    return EventBatch(float(raw[0]), events, rank)


def _event(raw: object) -> Event | None:
    if isinstance(raw, Mapping):
        tag, fields = raw.get(TAG_KEY), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = BLOCK_STORED_FIELDS if tag == BLOCK_STORED else BLOCK_REMOVED_FIELDS if tag == BLOCK_REMOVED else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventDecodeError(f"an event is a tagged map or array, not {type(raw).__name__}")
    if tag == BLOCK_STORED:
        return Stored(_hashes(fields.get("block_hashes")), _optional_hash(fields.get("parent_block_hash")),
                      _ints(fields.get("token_ids"), "token_ids"), _int(fields.get("block_size"), "block_size"),
                      _optional_str(fields.get("lora_name")), _optional_str(fields.get("medium")),
                      _optional_int(fields.get("group_idx")))
    if tag == BLOCK_REMOVED:
        return Removed(_hashes(fields.get("block_hashes")), _optional_str(fields.get("medium")),
                       _optional_int(fields.get("group_idx")))
    if tag == ALL_BLOCKS_CLEARED:
        return Cleared()
    return None


def _hashes(value: object) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise KVEventDecodeError("block_hashes must be a list of integers or bytes")
    return tuple(value)


def _optional_hash(value: object) -> EngineHash | None:
    if value is None or isinstance(value, int | bytes):
        return value
    raise KVEventDecodeError("parent_block_hash must be an integer, bytes or nil")


def _ints(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise KVEventDecodeError(f"{name} must be a list of integers")
    return tuple(value)


def _int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVEventDecodeError(f"{name} must be a positive integer")
    return value


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None
