"""vLLM's KV-event messages: what the simulated worker encodes and what the router decodes.

The fixtures are built from the format itself: msgspec structs declared with vLLM's options (tagged,
``omit_defaults``; the events array-like in older releases, maps in current ones; the batch array-like)
and fields in vLLM's declaration order, encoded by msgspec as vLLM encodes them."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from extproc.kvcache.wire import Cleared, KVEventDecodeError, Removed, Stored, decode_batch, split_frames
from simworker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder, encode_batch


class CurrentBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class CurrentEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class CurrentStored(CurrentEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class CurrentRemoved(CurrentEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class CurrentCleared(CurrentEvent, tag="AllBlocksCleared"):
    pass


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]


TOKENS = list(range(100, 132))


def current_fixture() -> bytes:
    return msgspec.msgpack.encode(CurrentBatch(ts=1.5, data_parallel_rank=0, events=[
        CurrentStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=TOKENS, block_size=16,
                      lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                      kv_cache_spec_kind="full_attention"),
        CurrentRemoved(block_hashes=[7], medium="GPU", group_idx=0),
        CurrentCleared(),
    ]))


def test_the_simulated_worker_encodes_byte_for_byte_as_vllm_does() -> None:
    ours = encode_batch([BlockStored((2**64 - 1, 7), None, tuple(TOKENS), 16), BlockRemoved((7,)),
                         AllBlocksCleared()], data_parallel_rank=0, ts=1.5)
    assert ours == current_fixture()


def test_current_map_shaped_events_decode() -> None:
    batch = decode_batch(current_fixture())
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    assert batch.events == (Stored((2**64 - 1, 7), None, tuple(TOKENS), 16, None, "GPU", 0),
                            Removed((7,), "GPU", 0), Cleared())


def test_legacy_array_shaped_events_decode() -> None:
    payload = msgspec.msgpack.encode(LegacyBatch(ts=2.0, events=[
        LegacyStored(block_hashes=[5], parent_block_hash=4, token_ids=TOKENS[:16], block_size=16, lora_id=None,
                     medium=None),
        LegacyRemoved(block_hashes=[5], medium="GPU"),
    ]))
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (Stored((5,), 4, tuple(TOKENS[:16]), 16), Removed((5,), "GPU"))


def test_unknown_event_kinds_and_fields_are_skipped() -> None:
    payload = msgspec.msgpack.encode([3.0, [{"type": "BlockMoved", "to": "CPU"},
                                            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32],
                                             "medium": "GPU", "future_field": 1}], 0])
    assert decode_batch(payload).events == (Removed((b"\x01" * 32,), "GPU"),)


@pytest.mark.parametrize("payload", [
    b"\xc1", msgspec.msgpack.encode({"ts": "x"}), msgspec.msgpack.encode([1.0, [42]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "abc",
                                   "block_size": 16}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
                                   "block_size": 0}]]),
])
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_frames_from_the_pub_socket_and_from_a_replay() -> None:
    assert split_frames([b"kv", (5).to_bytes(8, "big"), b"p"]).sequence == 5
    end = split_frames([(-1).to_bytes(8, "big", signed=True), b""])
    assert end.sequence == -1 and end.payload == b""
    with pytest.raises(KVEventDecodeError):
        split_frames([b"kv", b"\x00", b"p"])


def test_the_recorder_merges_a_run_of_chained_stores_as_vllm_stores_new_blocks_at_once() -> None:
    recorder = KVEventRecorder(block_size=2)
    recorder.block_stored(1, None, (10, 11))
    recorder.block_stored(2, 1, (12, 13))
    recorder.block_stored(9, None, (20, 21))  # another prompt's first block: a new event
    recorder.block_removed(1)
    recorder.block_removed(2)
    assert recorder.take() == [BlockStored((1, 2), None, (10, 11, 12, 13), 2), BlockStored((9,), None, (20, 21), 2),
                               BlockRemoved((1, 2))]
    assert recorder.take() == []
