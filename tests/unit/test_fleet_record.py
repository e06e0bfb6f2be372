"""``WorkerRecord.from_redis``: a Redis hash (bytes, as the client answers, or text) read back as the record."""

from __future__ import annotations

import time

import pytest

from poolgate.kernel.fleet import WorkerRecord, WorkerState

RECORD = WorkerRecord(id="w1", pool="chat", model="m", host="10.0.0.1", port=8000, served_names=("m", "m-alias"),
                      state=WorkerState.DRAINING, kv_capacity_tokens=4096, kv_usage=0.25, ttft_ewma_s=0.125,
                      lora_adapters=("a1",), node="n1", updated_at=1700000000.5, registered_at=1700000000.0)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_a_record_reads_back_as_it_was_written(as_bytes: bool) -> None:
    raw = RECORD.to_redis()
    read = WorkerRecord.from_redis({k.encode(): v.encode() for k, v in raw.items()} if as_bytes else raw)
    assert read == RECORD
    assert type(read.port) is int and type(read.kv_usage) is float and read.state is WorkerState.DRAINING
    assert read.served_names == ("m", "m-alias") and read.address == "10.0.0.1:8000"


def test_fields_the_hash_lacks_take_their_defaults_and_unknown_ones_are_ignored() -> None:
    before = time.time()
    read = WorkerRecord.from_redis({b"id": b"w2", b"pool": b"chat", b"model": b"m", b"host": b"10.0.0.2",
                                    b"port": b"8001", b"from_a_newer_writer": b"x"})
    assert read == WorkerRecord(id="w2", pool="chat", model="m", host="10.0.0.2", port=8001,
                                updated_at=read.updated_at)
    assert read.updated_at >= before  # a default from its factory, as the constructor gives it
    assert read.state is WorkerState.READY and read.lora_adapters == () and read.kv_usage == 0.0


def test_a_hash_without_its_identity_or_with_an_unknown_state_is_refused() -> None:
    raw = {k.encode(): v.encode() for k, v in RECORD.to_redis().items()}
    with pytest.raises(TypeError):
        WorkerRecord.from_redis({k: v for k, v in raw.items() if k != b"host"})
    with pytest.raises(ValueError):
        WorkerRecord.from_redis({**raw, b"state": b"Sleeping"})


def test_a_record_read_back_is_an_ordinary_record() -> None:
    read = WorkerRecord.from_redis(RECORD.to_redis())
    with pytest.raises(AttributeError):
        read.port = 1  # type: ignore[misc]  # frozen as any other
    assert hash(read) == hash(RECORD) and read.with_live(state=WorkerState.READY).state is WorkerState.READY
