"""The KV-event index: blocks stored, removed and cleared per worker; lookups of a prompt's cached prefix;
gaps, restarts and replays of a worker's stream; pending blocks of this replica's own placements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import msgspec

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.stream import WorkerStream
from extproc.kvcache.wire import Cleared, EventBatch, Frame, Removed, Stored

BLOCK = 4
PROMPT = tuple(range(1, 33))  # 8 blocks
KEYS = prompt_keys(PROMPT, BLOCK)


def stored(first: int, blocks: int, parent: int | None = None, tokens: tuple[int, ...] = PROMPT,
           base: int = 100) -> Stored:
    """Blocks ``first`` … ``first + blocks - 1`` of ``tokens``, with engine hashes ``base + i`` (any seed)."""
    return Stored(tuple(base + i for i in range(first, first + blocks)), parent,
                  tokens[first * BLOCK:(first + blocks) * BLOCK], BLOCK)


def batch(*events: Stored | Removed | Cleared) -> EventBatch:
    return EventBatch(0.0, events)


def known_index(*workers: str) -> PrefixIndex:
    index = PrefixIndex()
    for worker in workers:
        index.mark_known(worker)
    return index


def test_stored_blocks_are_found_by_the_routers_own_keys_whatever_the_engines_hashes() -> None:
    index = known_index("a", "b")
    index.apply("a", batch(stored(0, 3, base=100), stored(3, 2, parent=102, base=100)))
    index.apply("b", batch(stored(0, 2, base=9000)))  # another hash seed: other engine hashes, same keys
    assert index.cached_blocks(KEYS, ["a", "b"], now=0.0) == {"a": 5, "b": 2}


def test_removals_map_engine_hashes_back_to_keys_and_a_clear_empties_the_worker() -> None:
    index = known_index("a")
    index.apply("a", batch(stored(0, 4)))
    index.apply("a", batch(Removed((102, 103))))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 2}
    index.apply("a", batch(Cleared()))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 0}
    assert index.stats().blocks == 0


def test_a_gap_in_the_middle_of_a_prefix_ends_the_cached_run() -> None:
    index = known_index("a")
    index.apply("a", batch(stored(0, 6)))
    index.apply("a", batch(Removed((102,))))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 2}


def test_unknown_workers_are_left_out_never_reported_empty() -> None:
    index = known_index("a")
    index.apply("a", batch(stored(0, 2)))
    index.apply("b", batch(stored(0, 8)))
    assert index.cached_blocks(KEYS, ["a", "b", "c"], 0.0) == {"a": 2}
    index.mark_unknown("a")
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {}


def test_offloaded_and_orphaned_blocks_are_not_counted_as_hits() -> None:
    index = known_index("a")
    cpu = Stored((1,), None, PROMPT[:BLOCK], BLOCK, medium="CPU")
    orphan = Stored((5,), 4, PROMPT[BLOCK:2 * BLOCK], BLOCK)  # its parent was never reported
    index.apply("a", batch(cpu, orphan))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 0}


def test_adapter_blocks_do_not_answer_for_the_base_model() -> None:
    index = known_index("a")
    index.apply("a", batch(Stored((1, 2), None, PROMPT[:8], BLOCK, lora_name="sql")))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 0}
    assert index.cached_blocks(prompt_keys(PROMPT, BLOCK, "sql"), ["a"], 0.0) == {"a": 2}


def test_memory_is_bounded_by_dropping_the_oldest_blocks_of_the_largest_worker() -> None:
    index = PrefixIndex(max_blocks=6)
    index.mark_known("a")
    index.mark_known("b")
    index.apply("a", batch(stored(0, 5)))
    index.apply("b", batch(stored(0, 3, base=500)))
    assert index.stats().blocks == 6
    assert index.cached_blocks(KEYS, ["a", "b"], 0.0) == {"a": 0, "b": 3}  # a lost its oldest: the head


def test_pending_blocks_count_until_they_expire() -> None:
    index = PrefixIndex(pending_s=2.0)
    index.mark_known("a")
    index.mark_known("b")
    index.add_pending("b", KEYS[:3], now=10.0)
    assert index.cached_blocks(KEYS, ["a", "b"], now=11.0) == {"a": 0, "b": 3}
    assert index.cached_blocks(KEYS, ["a", "b"], now=12.5) == {"a": 0, "b": 0}
    index.expire_pending(12.5)
    assert index.stats().pending_keys == 0


def payload(*events: Stored | Removed | Cleared) -> bytes:
    def wire(event: Stored | Removed | Cleared) -> dict[str, object]:
        if isinstance(event, Stored):
            return {"type": "BlockStored", "block_hashes": list(event.engine_hashes),
                    "parent_block_hash": event.parent_engine_hash, "token_ids": list(event.token_ids),
                    "block_size": event.block_size}
        if isinstance(event, Removed):
            return {"type": "BlockRemoved", "block_hashes": list(event.engine_hashes)}
        return {"type": "AllBlocksCleared"}
    return msgspec.msgpack.encode([0.0, [wire(e) for e in events], 0])


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def stream_of(index: PrefixIndex, clock: Clock | None = None) -> WorkerStream:
    return WorkerStream("a", index, clock or Clock(), relearn_s=30.0)


def test_a_stream_in_order_is_known_from_its_first_batch() -> None:
    index = PrefixIndex()
    stream = stream_of(index)
    frame = Frame(0, payload(stored(0, 2)))
    assert stream.replay_from(0) is None
    stream.accept(frame)
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 2}


def test_a_gap_makes_the_worker_unknown_until_the_replay_fills_it() -> None:
    index = PrefixIndex()
    stream = stream_of(index)
    stream.accept(Frame(0, payload(stored(0, 2))))
    assert stream.replay_from(3) == 1
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {}  # behind: unknown
    stream.catch_up(1, 3, [Frame(1, payload(stored(2, 1, parent=101))), Frame(2, payload(Removed((101,))))])
    stream.accept(Frame(3, payload()))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 1}  # the replayed removal of block 1 counts
    assert stream.lost == 0


def test_history_that_cannot_be_replayed_is_forgotten_and_relearned() -> None:
    index = PrefixIndex()
    clock = Clock()
    stream = stream_of(index, clock)
    stream.accept(Frame(0, payload(stored(0, 4))))
    assert stream.replay_from(5) == 1
    stream.catch_up(1, 5, [Frame(3, payload())])  # the buffer no longer starts at 1
    stream.accept(Frame(5, payload(stored(0, 1, base=700))))
    assert stream.lost == 1 and index.cached_blocks(KEYS, ["a"], 0.0) == {}
    clock.now = 31.0
    stream.accept(Frame(6, payload()))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 1}  # only what it stored since the loss


def test_a_restarted_publisher_empties_the_worker_at_its_first_batch() -> None:
    index = PrefixIndex()
    stream = stream_of(index)
    for sequence in range(3):
        stream.accept(Frame(sequence, payload(stored(sequence, 1, parent=100 + sequence - 1 if sequence else None))))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 3}
    restarted = Frame(0, payload(stored(0, 1, tokens=tuple(range(500, 532)))))
    assert not stream.already_applied(restarted)
    assert stream.replay_from(0) is None
    stream.accept(restarted)
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 0}


def test_a_batch_seen_live_and_again_in_a_replay_is_applied_once() -> None:
    index = PrefixIndex()
    stream = stream_of(index)
    frame = Frame(0, payload(stored(0, 2)))
    stream.accept(frame)
    assert stream.already_applied(frame)


def test_joining_mid_stream_replays_from_the_start() -> None:
    index = PrefixIndex()
    stream = stream_of(index)
    assert stream.replay_from(2) == 0
    stream.catch_up(0, 2, [Frame(0, payload(stored(0, 1))), Frame(1, payload(stored(1, 1, parent=100)))])
    stream.accept(Frame(2, payload(stored(2, 1, parent=101))))
    assert index.cached_blocks(KEYS, ["a"], 0.0) == {"a": 3} and stream.lost == 0


def walked_key_by_key(index: PrefixIndex, keys: tuple[int, ...], workers: list[str], now: float,
                      pending: bool) -> dict[str, int]:
    """The cached prefix by its definition: for each known worker, the leading keys it holds (confirmed, or
    pending until after ``now`` when ``pending``)."""
    depth = {}
    for worker in workers:
        if not index.is_known(worker):
            continue
        position = 0
        for key in keys:
            held = worker in index.holders().get(key, ())
            until = index._pending.get(key, {}).get(worker) if pending else None
            if not (held or (until is not None and until > now)):
                break
            position += 1
        depth[worker] = position
    return depth


def test_the_fast_walk_gives_every_worker_its_leading_run_as_defined() -> None:
    """Random holdings with holes, partial prefixes, pending placements (some expired) and unknown workers:
    the walk that measures the runs all matching workers share in one go answers as the key-by-key one."""
    import random

    rng = random.Random(5)
    tokens = tuple(range(1, 4 * 60 + 1))
    keys = prompt_keys(tokens, BLOCK)
    for _ in range(200):
        index = PrefixIndex(pending_s=1.0)
        workers = [f"w{i}" for i in range(rng.randrange(1, 12))]
        for worker in workers:
            if rng.random() < 0.9:
                index.mark_known(worker)
            held = rng.randrange(0, len(keys) + 1)
            if held:
                index.apply(worker, batch(stored(0, held, tokens=tokens, base=1000 * len(worker) + held)))
            if held > 3 and rng.random() < 0.3:  # a hole: one block of the run evicted
                hole = rng.randrange(1, held)
                index.apply(worker, batch(Removed((1000 * len(worker) + held + hole,))))
            if rng.random() < 0.3:
                index.add_pending(worker, keys[:rng.randrange(1, len(keys) + 1)], now=rng.choice((0.0, 5.0)))
        for pending in (True, False):
            assert index.cached_blocks(keys, workers, 5.5, pending) == walked_key_by_key(
                index, keys, workers, 5.5, pending)


def test_a_prompts_block_keys_are_the_same_in_another_process() -> None:
    """Sibling processes and replicas on other hosts tell each other the blocks they placed by key: a process
    with another string-hash salt must compute the same keys, for the base model and for an adapter."""
    token_ids = list(range(100, 180))
    script = ("import json, sys; from extproc.kvcache.keys import prompt_keys; ids = json.loads(sys.argv[1]); "
              "print(json.dumps([prompt_keys(ids, 16), prompt_keys(ids, 16, 'sql-lora')]))")
    other = subprocess.run([sys.executable, "-c", script, json.dumps(token_ids)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    here = [prompt_keys(token_ids, 16), prompt_keys(token_ids, 16, "sql-lora")]
    assert json.loads(other.stdout) == [list(keys) for keys in here]
    assert here[0] != here[1] and len(here[0]) == 5
