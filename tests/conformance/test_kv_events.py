"""The KV-cache event wire format poolgate's precise prefix cache reads, live (ZMQ SUB) and through the replay
socket, held against the simulated worker and a real vLLM.

What extproc relies on: messages of three frames (topic, 8-byte big-endian sequence, msgpack ``KVEventBatch``)
with rising sequence numbers; ``BlockStored`` per full block of a prompt, carrying the block's token ids and the
block size, chained by parent hashes; ``AllBlocksCleared`` after ``/reset_prefix_cache`` (published with the
engine's next step, so a request follows the reset); the replay ROUTER resending a batch by its number, then an
end marker. Prompts are token ids, so the blocks' tokens are known exactly on both engines.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from extproc.kvcache.subscriber import fetch_replay
from extproc.kvcache.wire import Cleared, EventBatch, Frame, Stored, decode_batch, split_frames
from tests.conformance.conftest import BLOCK_SIZE, Engine


@pytest.fixture()
async def subscriber(engine: Engine) -> AsyncIterator[tuple[Engine, zmq.asyncio.Socket, zmq.asyncio.Context]]:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, engine.topic.encode())
    socket.connect(engine.kv_endpoint)
    await asyncio.sleep(0.5)  # a SUB socket sees only what is published after its subscription arrived
    yield engine, socket, context
    socket.close(linger=0)
    context.term()


async def _collect(socket: zmq.asyncio.Socket, until: float, done: object) -> list[tuple[list[bytes], Frame]]:
    """Messages until ``done(frames so far)`` holds or ``until`` (monotonic) passes."""
    got: list[tuple[list[bytes], Frame]] = []
    while (left := until - time.monotonic()) > 0 and not done(got):  # type: ignore[operator]
        if await socket.poll(left * 1000):
            parts = await socket.recv_multipart()
            got.append((parts, split_frames(parts)))
    return got


def _events(got: list[tuple[list[bytes], Frame]]) -> list[object]:
    return [event for _, frame in got for event in decode_batch(frame.payload).events]


def _prompt() -> list[int]:
    """Three full blocks and a bit, of ids no earlier request used (so every block is new to the cache)."""
    rng = random.Random(time.time_ns())
    return [rng.randrange(10, 4000) for _ in range(3 * BLOCK_SIZE + 10)]


async def _complete(engine: Engine, prompt: list[int] | str, max_tokens: int = 2) -> None:
    answer = await asyncio.to_thread(engine.post, "/v1/completions",
                                     {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens})
    assert answer.status_code == 200, answer.text


async def test_a_prompts_full_blocks_are_published_with_their_tokens(
        subscriber: tuple[Engine, zmq.asyncio.Socket, zmq.asyncio.Context]) -> None:
    engine, socket, _ = subscriber
    prompt = _prompt()
    await _complete(engine, prompt)

    def stored_all(got: list[tuple[list[bytes], Frame]]) -> bool:
        return sum(len(e.engine_hashes) for e in _events(got) if isinstance(e, Stored)) >= 3  # type: ignore[misc]

    got = await _collect(socket, time.monotonic() + 10, stored_all)
    assert got, "no KV event arrived"
    for parts, frame in got:
        assert len(parts) == 3 and parts[0] == engine.topic.encode() and len(parts[1]) == 8
        raw = msgspec.msgpack.decode(frame.payload)
        assert isinstance(raw, list) and isinstance(raw[0], float) and isinstance(raw[1], list)
        assert all(isinstance(event, dict) and "type" in event for event in raw[1])  # maps tagged by type
    sequences = [frame.sequence for _, frame in got]
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    stored = [event for event in _events(got) if isinstance(event, Stored)]
    tokens = [t for event in stored for t in event.token_ids]
    assert tokens == prompt[:3 * BLOCK_SIZE]
    assert {event.block_size for event in stored} == {BLOCK_SIZE}
    hashes = [h for event in stored for h in event.engine_hashes]
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert stored[0].parent_engine_hash is None
    for before, after in itertools.pairwise(stored):  # a batch continues the chain of the one before
        assert after.parent_engine_hash == before.engine_hashes[-1]


async def test_a_repeated_prompt_stores_no_block_again(
        subscriber: tuple[Engine, zmq.asyncio.Socket, zmq.asyncio.Context]) -> None:
    """A prefix-cache hit publishes nothing new: what the index holds stays true without duplicates."""
    engine, socket, _ = subscriber
    prompt = _prompt()
    await _complete(engine, prompt)
    await _collect(socket, time.monotonic() + 3, lambda got: False)
    await _complete(engine, prompt)
    again = await _collect(socket, time.monotonic() + 2, lambda got: False)
    assert not [event for event in _events(again) if isinstance(event, Stored)]


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
        subscriber: tuple[Engine, zmq.asyncio.Socket, zmq.asyncio.Context]) -> None:
    engine, socket, _ = subscriber
    await _complete(engine, _prompt())
    await _collect(socket, time.monotonic() + 3, lambda got: False)
    reset = await asyncio.to_thread(engine.post, "/reset_prefix_cache", {})
    assert reset.status_code == 200
    await _complete(engine, "after the reset")  # vLLM publishes the clearing with its next engine step
    got = await _collect(socket, time.monotonic() + 10,
                         lambda got: any(isinstance(e, Cleared) for e in _events(got)))
    assert any(isinstance(event, Cleared) for event in _events(got))


async def test_replay_resends_a_batch_by_its_number(
        subscriber: tuple[Engine, zmq.asyncio.Socket, zmq.asyncio.Context]) -> None:
    """A subscriber that missed sequence numbers asks the replay ROUTER: the same payloads, then the end."""
    engine, socket, context = subscriber
    await _complete(engine, _prompt())
    live = await _collect(socket, time.monotonic() + 10, lambda got: any(
        isinstance(e, Stored) for e in _events(got)))
    assert live
    first = live[0][1].sequence
    replayed = await fetch_replay(context, engine.kv_replay_endpoint, first, timeout_s=5)
    assert [frame.sequence for frame in replayed[:len(live)]] == [frame.sequence for _, frame in live]
    assert [frame.payload for frame in replayed[:len(live)]] == [frame.payload for _, frame in live]
    batch: EventBatch = decode_batch(replayed[0].payload)
    assert batch.events
