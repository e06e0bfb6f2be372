"""The picking step alone: ``Scheduler.pick`` over frozen snapshots of 1,000 to 10,000 workers.

Each scenario builds one snapshot with randomised live state (KV usage and capacity, queue, prefill rate,
step time, a few stale, draining or low-on-GPU-memory workers) and a list of pre-profiled requests of mixed sizes,
then times every pick with ``perf_counter_ns`` and reports p50/p90/p99 per pick in µs against the
scenario's target: p99 ≤ 100 µs for the common shape, a model served by a few pools (``per-model``), ≤ 200 µs
for one pool of 1,000 workers (``one-pool``) and ≤ 500 µs with 10,000 workers in 200 pools (``10k-workers``).
Models with more than ``sampling.SAMPLE_ABOVE`` Ready workers are picked over a sample of them. On a shared
or busy machine the p99 of all picks is mostly other processes' interruptions, so the report also gives
``own p99``: the p99 over requests of each request's fastest of 20 picks, i.e. what the pick itself
costs for the slowest requests. Profiling a request (token estimate, task class, prefix hashes) is timed
separately; it happens once per request, outside the pick. Where the KV index is in use (``kv-events``) the
placement that follows each pick is timed too (``commit µs``, the median of ``Place.commit`` and ``release``:
in-flight count, reservation, prefill ledger, the prompt's blocks marked pending on the worker).

Scenarios: ``per-model`` (25 models × 2 pools × 20 workers: 40 candidates), ``restricted`` (the same with
every second pool taking only long-context requests), ``busy`` (per-model plus reservations on every worker,
a full affinity map and the latest placements on each worker), ``kv-events`` (per-model with every worker
publishing KV events: each model has eight 4-8k-token documents, each held whole or in part by a third of its
workers, and every request asks about one of them, so the pick walks the KV index for the cached prefix of
250-500 blocks), ``one-model`` (all 1,000 workers, in 50 pools, serve one model), ``one-pool`` (one pool of
1,000 workers), ``10k-workers`` (10,000 workers in 200 pools of 25 models: 400 per model).

    .venv/bin/python -m bench.pick_microbench [--picks 20000] [--scenarios kv-events]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import host_quiet
from bench.report import Column, Panel, save_rows
from extproc.inflight import InflightTracker
from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.wire import EventBatch, Stored
from extproc.metrics import Metrics
from extproc.pipeline.place import Place
from extproc.prefill_ledger import PrefillLedger
from extproc.request import RequestFacts
from extproc.scheduling import Decision, PickContext, PickRequest, RequestProfiler, Scheduler, build_scheduler
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings, TaskClass
from poolgate.kernel.fleet import WorkerRecord, WorkerState

WORKERS = 1000
POOLS = 50
NOW = 1_000_000.0
TARGET_P99_US = 100.0


@dataclass(frozen=True)
class Scenario:
    name: str
    models: int
    restricted: bool = False
    busy: bool = False
    kv_events: bool = False
    workers: int = WORKERS
    pools: int = POOLS
    target_p99_us: float = TARGET_P99_US


SCENARIOS = (Scenario("per-model", 25), Scenario("restricted", 25, restricted=True),
             Scenario("busy", 25, busy=True), Scenario("kv-events", 25, kv_events=True), Scenario("one-model", 1),
             Scenario("one-pool", 1, pools=1, target_p99_us=200.0),
             Scenario("10k-workers", 25, workers=10_000, pools=200, target_p99_us=500.0))


def fleet(scenario: Scenario, rng: random.Random) -> tuple[tuple[PoolSpec, ...], list[WorkerRecord]]:
    pools = []
    for index in range(scenario.pools):
        classes: tuple[TaskClass, ...] = ("long_context",) if scenario.restricted and index % 2 else ()
        pools.append(PoolSpec(name=f"pool-{index}", model=f"model-{index % scenario.models}", task_classes=classes,
                              max_model_len=rng.choice((8192, 16384, 32768))))
    workers = []
    for index in range(scenario.workers):
        pool = pools[index % scenario.pools]
        roll = rng.random()
        state = WorkerState.DRAINING if roll < 0.02 else WorkerState.READY
        workers.append(WorkerRecord(
            id=f"w{index:05d}", pool=pool.name, model=pool.model,
            host=f"10.{index // 62500}.{index // 250 % 250}.{index % 250}",
            port=8000, max_model_len=pool.max_model_len, state=state,
            kv_capacity_tokens=rng.choice((0, 200_000, 400_000, 800_000)) if roll > 0.03 else 0,
            kv_usage=rng.random() * 0.95, running=rng.randrange(0, 64), waiting=rng.randrange(0, 8),
            prefill_tokens_per_s=rng.choice((0.0, 6000.0, 12000.0)),
            inter_token_s=rng.choice((-1.0, 0.008, 0.03, 0.07)),
            gpu_memory_free_mib=rng.uniform(100, 400) if rng.random() < 0.02 else rng.uniform(2000, 8000),
            updated_at=NOW - (5.0 if 0.02 <= roll < 0.04 else rng.random()),
        ))
    return tuple(pools), workers


def requests(scenario: Scenario, profiler: RequestProfiler, rng: random.Random, count: int) -> list[PickRequest]:
    shared_system = "You are a careful assistant. " * 40
    made = []
    for _ in range(count):
        chars = rng.choice((200, 2000, 8000, 40_000))
        text = shared_system + "".join(rng.choice("abcdefgh ") for _ in range(min(chars, 400)))
        text += "x" * max(0, chars - len(text))
        facts = RequestFacts("/v1/chat/completions", "POST", f"model-{rng.randrange(scenario.models)}",
                             stream=rng.random() < 0.5, max_tokens=rng.choice((None, 128, 1024)),
                             prompt_chars=len(text), message_count=2, prompt_parts=("system", text),
                             session_id=f"s{rng.randrange(500)}" if rng.random() < 0.3 else "")
        made.append(profiler.profile(facts))
    return made


def documents_held(snapshot: FleetSnapshot, workers: Sequence[WorkerRecord], made: Sequence[PickRequest],
                   rng: random.Random) -> tuple[CacheLookup, list[PickRequest]]:
    """Every worker publishes KV events; each model's documents are held, whole or their first part, by a
    third of its workers; each request asks a question about one document (its blocks: the document's and
    its own)."""
    index = PrefixIndex()
    documents: dict[str, list[list[int]]] = {}
    for worker in workers:
        index.mark_known(worker.id)
    for model in sorted({w.model for w in workers}):
        documents[model] = docs = [[rng.randrange(1, 128_000) for _ in range(rng.randrange(4000, 8000))]
                                   for _ in range(8)]
        for doc in docs:
            for worker in rng.sample(snapshot.workers_for(model), len(snapshot.workers_for(model)) // 3):
                blocks = rng.choice((len(doc) // 16, rng.randrange(1, len(doc) // 16)))
                stored = Stored(tuple(rng.getrandbits(63) for _ in range(blocks)), None, tuple(doc[:blocks * 16]), 16)
                index.apply(worker.id, EventBatch(NOW, (stored,)))
    asked = []
    for request in made:
        question = [rng.randrange(1, 128_000) for _ in range(rng.randrange(20, 200))]
        tokens = rng.choice(documents[request.model]) + question
        asked.append(replace(request, prompt_tokens=len(tokens),
                             prompt_blocks=PromptBlocks(len(tokens), {16: prompt_keys(tokens, 16)})))
    return CacheLookup(index, lambda: snapshot, clock=lambda: NOW), asked


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(scenario: Scenario, picks: int, seed: int = 1) -> dict[str, float | int | str]:
    rng = random.Random(seed)
    settings = SchedulingSettings(gpu_memory_min_free_mib=500)
    pools, workers = fleet(scenario, rng)
    snapshot = build_snapshot(workers, pools, taken_at=NOW, stale_after_s=3.0)
    profiler = RequestProfiler(settings)
    pool_of_requests = requests(scenario, profiler, rng, 500)
    inflight = {w.id: rng.randrange(0, 20) for w in workers}
    reserved: dict[str, int] = {}
    pending: dict[str, int] = {}
    affinity: dict[Hashable, str] = {}
    latest: PrefillLedger | None = None
    if scenario.busy:
        reserved = {w.id: rng.randrange(0, 20_000) for w in workers}
        pending = {w.id: rng.randrange(0, 4_000) for w in workers}
        latest = PrefillLedger(settings.default_prefill_tokens_per_s)  # what each worker's queue was sent
        for w in workers:
            for _ in range(rng.randrange(1, 40)):
                latest.placed(w, rng.randrange(20, 8_000), NOW - 60.0)
        for request in pool_of_requests:
            for key in request.affinity_keys:
                affinity[key] = rng.choice(snapshot.workers_for(request.model)).id
        affinity.update({("filler", i): "w00000" for i in range(50_000 - len(affinity))})
    prefix_cache = None
    if scenario.kv_events:
        prefix_cache, pool_of_requests = documents_held(snapshot, workers, pool_of_requests, rng)
    context = PickContext(snapshot, inflight, reserved, pending, affinity, latest_prefill=latest)

    def fresh() -> PickContext:
        """Each pick reads the KV index through its own view, as extproc's placement builds one per pick."""
        return context if prefix_cache is None else replace(context, prefix_cache=prefix_cache.for_pick())
    scheduler = build_scheduler(settings, random.Random(seed))

    facts = [r.facts for r in pool_of_requests]
    started = time.perf_counter()
    for index in range(picks // 10):
        profiler.profile(facts[index % len(facts)])
    profile_us = (time.perf_counter() - started) / (picks // 10) * 1e6

    samples = []
    outcomes: dict[str, int] = {}
    timer = time.perf_counter_ns
    for request in pool_of_requests[:50]:  # warm up
        scheduler.pick(request, fresh())
    gc.collect()
    for index in range(picks):
        request = pool_of_requests[index % len(pool_of_requests)]
        view = fresh()
        before = timer()
        outcome = scheduler.pick(request, view)
        samples.append((timer() - before) / 1000)
        kind = type(outcome).__name__
        outcomes[kind] = outcomes.get(kind, 0) + 1
    candidates = statistics.mean(len(snapshot.workers_for(r.model)) for r in pool_of_requests)
    # Each request's best of several picks: its own cost without other processes' interruptions.
    repeats = 20 if candidates < 200 else 3
    best = []
    for request in pool_of_requests:
        fastest = float("inf")
        for _ in range(repeats):
            view = fresh()
            before = timer()
            scheduler.pick(request, view)
            fastest = min(fastest, (timer() - before) / 1000)
        best.append(fastest)
    commit_us = commit_cost(scheduler, snapshot, settings, prefix_cache, pool_of_requests, picks, timer) \
        if prefix_cache is not None else math.nan
    return {
        "scenario": scenario.name, "candidates": round(candidates), "picks": picks, "commit_p50_us": commit_us,
        "p50_us": percentile(samples, 0.50), "p90_us": percentile(samples, 0.90),
        "p99_us": percentile(samples, 0.99), "mean_us": statistics.fmean(samples), "profile_us": profile_us,
        "own_p99_us": percentile(best, 0.99),
        "placed_share": outcomes.get("Decision", 0) / picks,
        "target_p99_us": scenario.target_p99_us,
    }


def commit_cost(scheduler: Scheduler, snapshot: FleetSnapshot, settings: SchedulingSettings, lookup: CacheLookup,
                made: Sequence[PickRequest], picks: int, timer: Callable[[], int]) -> float:
    """Median µs of placing a picked request and releasing it (``Place.commit`` and ``release``: in-flight count,
    reservation, prefill ledger, the prompt's blocks marked pending), on the request path after each pick."""
    place = Place(scheduler, SimpleNamespace(snapshot=snapshot), InflightTracker(), Metrics(), settings,
                  clock=lambda: NOW, prefix_cache=lookup)
    decided = [(r, d) for r in made if isinstance(d := scheduler.pick(r, place.context()), Decision)]
    samples = []
    for index in range(picks):
        request, decision = decided[index % len(decided)]
        before = timer()
        place.release(place.commit(request, decision))
        samples.append((timer() - before) / 1000)
    return statistics.median(samples)


COLUMNS = (Column("scenario", "scenario", "{}"), Column("candidates", "workers/model", "{}"),
           Column("p50_us", "p50 µs", "{:.1f}"), Column("p90_us", "p90 µs", "{:.1f}"),
           Column("p99_us", "p99 µs", "{:.1f}"), Column("mean_us", "mean µs", "{:.1f}"),
           Column("own_p99_us", "own p99 µs", "{:.1f}"), Column("commit_p50_us", "commit µs", "{:.1f}"),
           Column("profile_us", "profile µs", "{:.1f}"), Column("placed_share", "placed", "{:.0%}"),
           Column("target_p99_us", "target µs", "{:.0f}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--picks", type=int, default=20_000, help="picks timed per scenario")
    parser.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS),
                        help="comma-separated, of: " + ", ".join(s.name for s in SCENARIOS))
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if s.name in args.scenarios.split(",")]
    with host_quiet.measure() as quiet:
        rows = [run(scenario, args.picks) for scenario in chosen]
    save_rows("pick_microbench", rows, COLUMNS, x_key="candidates",
              panels=(Panel("pick time per candidate count", ("p50_us", "p99_us", "own_p99_us"), "µs", log_y=True),),
              parameters={"picks": args.picks, "cpus": os.cpu_count(),
                          "load_average_1m": round(os.getloadavg()[0], 2)}, host=quiet.stop())
    for row in rows:
        for key, label in (("p99_us", "p99 of all picks"), ("own_p99_us", "p99 of each request's own cost")):
            target = float(row["target_p99_us"])
            verdict = "meets" if float(row[key]) <= target else "misses"
            print(f"{row['scenario']} {label}: {float(row[key]):.1f} µs, {verdict} the {target:.0f} µs target")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; other processes widen the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
