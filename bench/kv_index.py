"""What the KV-event index costs: memory per tracked block, event processing, and a 16k-token lookup.

For each fleet size the index is filled from synthetic ``BlockStored`` batches as vLLM sends them (runs of
16-token blocks chained from their parent), every worker holding ``--blocks-per-worker`` blocks made of
shared documents (each document on a few workers) and private tails. Measured:

- bytes per tracked (worker, block) entry (``tracemalloc`` over building the index);
- applying events: µs per stored block (the CPU one subscription costs per block the engine caches);
- a lookup of a 16k-token prompt (1,000 blocks) against all workers: ``warm-3`` (three workers hold the
  whole prompt, the rest none: the common case) and ``warm-all`` (every worker holds it: the worst case);
- per request, off the loop: tokenising the 16k-token prompt (the simulated tokenizer) and its block keys.

    .venv/bin/python -m bench.kv_index [--workers 10 100 1000] [--blocks-per-worker 2000]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import host_quiet
from bench.report import Column, Panel, save_rows
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.tokenizer import SimTokenizer, prompt_token_ids
from extproc.kvcache.wire import EventBatch, Stored

BLOCK = 16
PROMPT_TOKENS = 16_384
DOCUMENT_BLOCKS = 250
RUN_BLOCKS = 50
"""Blocks per ``BlockStored`` event (vLLM stores a step's new blocks of one request at once)."""


def document_tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 128_000) for _ in range(blocks * BLOCK)]


def worker_batches(worker: int, documents: list[list[int]], blocks: int, rng: random.Random) -> list[EventBatch]:
    """Batches that leave ``worker`` holding about ``blocks`` blocks: documents it shares, then private ones."""
    batches: list[EventBatch] = []
    held = 0
    engine_hash = worker << 32
    while held < blocks:
        tokens = rng.choice(documents) if rng.random() < 0.5 else document_tokens(rng, DOCUMENT_BLOCKS)
        parent: int | None = None
        for start in range(0, len(tokens) // BLOCK, RUN_BLOCKS):
            run = min(RUN_BLOCKS, len(tokens) // BLOCK - start)
            hashes = tuple(range(engine_hash, engine_hash + run))
            batches.append(EventBatch(0.0, (Stored(hashes, parent, tuple(tokens[start * BLOCK:(start + run) * BLOCK]),
                                                   BLOCK),)))
            parent = hashes[-1]
            engine_hash += run
        held += len(tokens) // BLOCK
    return batches


def apply_all(batches: dict[int, list[EventBatch]], max_blocks: int) -> PrefixIndex:
    index = PrefixIndex(max_blocks=max_blocks)
    for worker, items in batches.items():
        worker_id = f"w{worker}"
        index.mark_known(worker_id)
        for batch in items:
            index.apply(worker_id, batch)
    return index


def filled_index(workers: int, blocks_per_worker: int, rng: random.Random) -> tuple[PrefixIndex, float, float]:
    """The index, bytes per entry (traced while building it once), µs per stored block (timed untraced)."""
    documents = [document_tokens(rng, DOCUMENT_BLOCKS) for _ in range(max(4, workers // 3))]
    batches = {w: worker_batches(w, documents, blocks_per_worker, rng) for w in range(workers)}
    bound = workers * blocks_per_worker * 2
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traced = apply_all(batches, bound)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = traced.stats().blocks
    del traced
    gc.collect()
    started = time.perf_counter()
    index = apply_all(batches, bound)
    elapsed = time.perf_counter() - started
    return index, (after - before) / entries, elapsed / entries * 1e6


def lookup_us(index: PrefixIndex, keys: tuple[int, ...], workers: list[str], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        index.cached_blocks(keys, workers, 0.0)
        samples.append(time.perf_counter() - started)
    return min(samples) * 1e6


def hold_prompt(index: PrefixIndex, worker_ids: list[str], tokens: list[int]) -> None:
    for number, worker_id in enumerate(worker_ids):
        hashes = tuple(range(1 << 60 | number << 20, (1 << 60 | number << 20) + len(tokens) // BLOCK))
        index.apply(worker_id, EventBatch(0.0, (Stored(hashes, None, tuple(tokens), BLOCK),)))


def run(workers: int, blocks_per_worker: int, repeats: int, seed: int) -> dict[str, float | int | str]:
    rng = random.Random(seed)
    index, bytes_per_block, apply_us = filled_index(workers, blocks_per_worker, rng)
    worker_ids = [f"w{w}" for w in range(workers)]
    prompt = document_tokens(rng, PROMPT_TOKENS // BLOCK)
    keys = prompt_keys(prompt, BLOCK)
    hold_prompt(index, worker_ids[:3], prompt)
    warm_three = lookup_us(index, keys, worker_ids, repeats)
    hold_prompt(index, worker_ids, prompt)
    warm_all = lookup_us(index, keys, worker_ids, repeats)
    return {"workers": workers, "blocks": index.stats().blocks, "bytes_per_block": round(bytes_per_block, 1),
            "index_mib": round(bytes_per_block * index.stats().blocks / 2**20, 1),
            "apply_us_per_block": round(apply_us, 3), "lookup_warm3_us": round(warm_three, 1),
            "lookup_warm_all_us": round(warm_all, 1)}


def per_request_costs(repeats: int) -> dict[str, float]:
    """Tokenising a 16k-token chat prompt with the simulated tokenizer, and its block keys."""
    rng = random.Random(7)
    words = [f"word{rng.randrange(5000)}" for _ in range(PROMPT_TOKENS - 8)]
    body = {"messages": [{"role": "user", "content": " ".join(words)}]}
    tokenizer = SimTokenizer()
    tokens: list[int] = []
    tokenise, keys = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = prompt_token_ids(body, tokenizer) or []
        middle = time.perf_counter()
        prompt_keys(tokens, BLOCK)
        tokenise.append(middle - started)
        keys.append(time.perf_counter() - middle)
    return {"prompt_tokens": len(tokens), "tokenise_ms": round(min(tokenise) * 1e3, 2),
            "tokenise_median_ms": round(statistics.median(tokenise) * 1e3, 2),
            "block_keys_ms": round(min(keys) * 1e3, 3)}


COLUMNS = (Column("workers", "workers", "{}"), Column("blocks", "blocks tracked", "{}"),
           Column("bytes_per_block", "bytes/block", "{:.0f}"), Column("index_mib", "index MiB", "{:.1f}"),
           Column("apply_us_per_block", "apply µs/block", "{:.2f}"),
           Column("lookup_warm3_us", "16k lookup µs (3 warm)", "{:.0f}"),
           Column("lookup_warm_all_us", "16k lookup µs (all warm)", "{:.0f}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--blocks-per-worker", type=int, default=2000,
                        help="blocks each worker caches (2000 x 16 tokens = 32k tokens; an H100 holds ~30k blocks)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with host_quiet.measure() as quiet:
        rows = [run(workers, args.blocks_per_worker, args.repeats, args.seed) for workers in args.workers]
        request = per_request_costs(args.repeats)
    save_rows("kv_index", rows, COLUMNS, x_key="workers",
              panels=(Panel("16k-token lookup", ("lookup_warm3_us", "lookup_warm_all_us"), "µs", log_y=True),
                      Panel("memory per tracked block", ("bytes_per_block",), "bytes")),
              parameters={"blocks_per_worker": args.blocks_per_worker, "block_size": BLOCK,
                          "prompt_tokens": PROMPT_TOKENS, "repeats": args.repeats, **request,
                          "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
              host=quiet.stop())
    print(f"per request: tokenising {request['prompt_tokens']} tokens {request['tokenise_ms']} ms "
          f"(median {request['tokenise_median_ms']} ms), block keys {request['block_keys_ms']} ms")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; times are each case's fastest run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
