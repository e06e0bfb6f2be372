"""The virtual-time lab: routing policies against simulated engines, on model time, in one process.

    poolgate bench lab [--quick] [--fleets …] [--scenarios …] [--routers …] [--levels …] [--processes 1,2,4]

A cell is a fleet (``FLEETS``), a scenario of ``bench peers`` (``bench.scenarios``: mix, sessions,
shared-docs), an arrival pattern (Poisson or on/off bursts) and a load level (a share of the fleet's
capacity). Every router of the cell replays the same seeded trace against a fresh fleet of simworker's
engine models (``lab_fleet``); poolgate runs its own scheduling code (``lab_routers.Poolgate``), the peers
their published algorithms. Nothing sleeps and nothing is sent over a socket, so a cell of thousands of
requests takes seconds and the same seed gives the same figures on any machine, loaded or not.

Capacity (per fleet and scenario) is found as ``bench peers`` finds it: closed-loop clients through
least-request, doubled until completions per second stop growing by 5 %; the level's rate is that share of it.

Reported per router and cell: TTFT p50 / p99 (a refused request counts as an infinite TTFT), goodput (the
share of requests whose first token came within their class's objective), the prefix-cache hit rate as vLLM
counts it (hit tokens / queried tokens at admission), refusals, the sequences the engines preempted (room a
router promised that the running streams then needed), the spread of requests over workers, and when the
requests that set the p99 (it and those slower) were sent, the first and the last (model seconds from the
trace's start: a tail sent in its first second is the cold start, every cache empty).
``bench/reports/lab.json`` and ``lab.png`` (p99 per cell and router) hold the run.

One trace's p99 is its tenth-worst request in a thousand, and a change anywhere before it (a tie drawn the
other way) moves it by 10 % or more either way: a default prefill rate that only counts until the engines'
first rates are read, a third of a model second in, moved the three H100s' shared documents (bursts, 85 %)
from 1.076 s to 1.008 and 1.217 s. ``--seeds K`` replays every cell with K traces (and the routers'
draws) and adds, per cell and router, the median p99 over them and poolgate's median ratio to the best peer
of the same trace (``over_seeds``): the figure to judge a policy change by. All seeds are offered the rate
found for ``--seed``.

Each cell also has a row ``bound`` that is no router: every request's least possible time to first token,
its prefill alone on an idle engine with every block an earlier request sent cached (``lab_bound``). No
router's p99 on that trace is below the bound's; its ``x best peer`` says how far under the best peer any
router could go, and a target under it is one no router meets.

``--fleet-scale N`` replays the cells on fleets of N times the workers at the base fleet's rates, where every
request is all but alone on an idle engine: queueing is gone, but it is no floor (spread over many engines a
session's turns and a document's questions lose their cache, which the base fleet keeps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench import host_quiet
from bench.lab_bound import bound_row_figures
from bench.lab_fleet import BLOCK_SIZE, SCRAPE_INTERVAL_S, START_TIME, LabFleet, LabWorker, VirtualLoop, WorkerPlan
from bench.lab_routers import (
    HOLD,
    CacheAware,
    DynamoKv,
    LabRequest,
    LabRouter,
    LeastRequest,
    Oracle,
    Poolgate,
    PowerOfTwo,
    records_snapshot,
)
from bench.measure import percentile
from bench.report import write_report
from bench.scenarios import SCENARIOS, Trace
from bench.sched_fleet import MODELS, POOL_MAX_MODEL_LEN, POOL_OF_ROLE
from bench.workload import ModelRole, RequestSpec
from extproc.errors import ApiError
from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.keys import prompt_keys
from extproc.request import RequestHead, facts_from_data
from extproc.scheduling import PLUGINS, RequestProfiler
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from simworker import protocol, tokens
from simworker.engine import EngineRequest, StepOutcome

FLEETS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "l4": (("chat", "l4-24gb", 6), ("code", "l4-24gb", 2)),
    "h100": (("chat", "h100-80gb", 3), ("code", "h100-80gb", 1)),
    "heterogeneous": (("chat", "l4-24gb", 6), ("chat", "h100-80gb", 2), ("code", "h100-80gb", 1),
                      ("code", "l4-24gb", 1)),
}
"""(pool, preset, count): two homogeneous fleets and ``bench peers``' heterogeneous one."""
ROUTERS = ("poolgate", "least_request", "power_of_two", "cache_aware", "dynamo_kv", "oracle")
BOUND = "bound"
"""The row of each cell that is no router: every request's least time to first token (``lab_bound``)."""
LEVELS = (0.5, 0.85, 1.0)
TARGET_LEVEL = 0.85
HOLD_RETRY_S = 0.05
"""How often held requests are tried again besides each finished request (extproc's queue wakes on both)."""
DRAIN_LIMIT_S = 600.0
"""Model seconds after the last arrival before the remaining requests are cut (counted as misses)."""
CAPACITY_WINDOW_S = 240.0
CAPACITY_PROBES = 11
CAPACITY_FILE = Path(__file__).resolve().parent / "lab_capacity.json"
"""Capacities found by ``--calibrate`` (fleet/scenario/seed → requests per model second): the search costs
minutes, and its answer only changes with the simulator's model or the scenarios."""
CAPACITY_CEILING_RPS = 1000.0
SERVED_WITHIN_S = 5.0
SERVED_SHARE = 0.95


# ---------------------------------------------------------------------------------------------- requests


class Tokeniser:
    """The simulated worker's parse of a body, with each chat message tokenised once: the scenarios repeat
    long system prompts and documents, and the template's markers split tokens at message boundaries, so a
    prompt's tokens are its messages' tokens end to end (``tests/unit/test_lab.py`` holds this to
    ``protocol.parse_chat``)."""

    def __init__(self) -> None:
        self._messages: dict[tuple[str, str], tuple[list[str], list[int]]] = {}
        self._priming = tokens.tokenize(tokens.render_chat([]))

    def parse(self, data: dict[str, Any]) -> tuple[protocol.GenerationRequest, list[int]]:
        if "messages" not in data:
            generation = protocol.parse_completion(data)
            return generation, tokens.token_ids(generation.prompt_tokens)
        words: list[str] = []
        ids: list[int] = []
        for message in data["messages"]:
            key = (message["role"], message["content"])
            known = self._messages.get(key)
            if known is None:
                text = tokens.render_chat([key]).removesuffix(tokens.render_chat([]))
                message_words = tokens.tokenize(text)
                known = self._messages[key] = (message_words, tokens.token_ids(message_words))
            words += known[0]
            ids += known[1]
        words += self._priming
        ids += tokens.token_ids(self._priming)
        shell = protocol.parse_chat({**data, "messages": [{"role": "user", "content": ""}]})
        return replace(shell, prompt_tokens=tuple(words)), ids


def lab_request(spec: RequestSpec, body: bytes, profiler: RequestProfiler, tokeniser: Tokeniser) -> LabRequest:
    """One trace request parsed and tokenised as the simulated worker does, profiled as poolgate does."""
    data = orjson.loads(body)
    generation, ids = tokeniser.parse(data)
    model = data["model"]
    plan = protocol.plan_generation(generation, POOL_MAX_MODEL_LEN[POOL_OF_ROLE[spec.role]], model)
    facts = facts_from_data(RequestHead("POST", spec.path, len(body)), data)
    if isinstance(facts, ApiError):
        raise ValueError(f"trace request {spec.index} is not a valid request: {facts.message}")
    return LabRequest(
        index=spec.index, arrival_s=spec.arrival_s, model=model, workload=spec.workload,
        slo_ttft_s=spec.slo_ttft_s, profile=profiler.profile(facts),
        blocks=PromptBlocks(len(ids), {BLOCK_SIZE: prompt_keys(ids, BLOCK_SIZE)}),
        engine=EngineRequest(request_id=str(spec.index), prompt_tokens=plan.prompt_tokens,
                             output_target=plan.output_target, finish_reason_at_target=plan.finish_reason,
                             prompt_block_hashes=tokens.block_hashes(generation.prompt_tokens, BLOCK_SIZE),
                             prompt_token_ids=tuple(ids)))


def lab_requests(trace: Trace, profiler: RequestProfiler, tokeniser: Tokeniser | None = None) -> list[LabRequest]:
    tokeniser = tokeniser or Tokeniser()
    return [lab_request(spec, body, profiler, tokeniser)
            for spec, body in zip(trace.requests, trace.bodies, strict=True)]


# ---------------------------------------------------------------------------------------------- one run


@dataclass
class Outcome:
    """What happened to each request of one run."""

    ttft_s: dict[int, float] = field(default_factory=dict)
    e2e_s: dict[int, float] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    worker_of: dict[int, str] = field(default_factory=dict)
    completed_at: list[float] = field(default_factory=list)


def scaled_fleet(fleet: str, scale: int) -> str:
    """The name of ``fleet`` with every worker count times ``scale`` (``--fleet-scale``)."""
    return fleet if scale == 1 else f"{fleet}×{scale}"


def fleet_plans(fleet: str) -> tuple[list[WorkerPlan], list[PoolSpec]]:
    plans: list[WorkerPlan] = []
    pools: dict[str, PoolSpec] = {}
    base, _, scale = fleet.partition("×")
    for pool, preset, count in FLEETS[base]:
        role: ModelRole = "chat" if pool == "chat" else "code"
        model = MODELS[role]
        pools.setdefault(pool, PoolSpec(name=pool, model=model, max_model_len=POOL_MAX_MODEL_LEN[pool]))
        for _ in range(count * int(scale or 1)):
            plans.append(WorkerPlan(f"{pool}-{preset.split('-')[0]}-{len(plans)}", pool, model, preset,
                                    POOL_MAX_MODEL_LEN[pool]))
    return plans, list(pools.values())


RouterFactory = Callable[[LabFleet, Sequence[PoolSpec], Callable[[], float]], LabRouter]


def router_factory(name: str, seed: int, settings: SchedulingSettings, processes: int = 1,
                   exchange_s: float = 0.05, siblings: bool = False) -> RouterFactory:
    def build(fleet: LabFleet, pools: Sequence[PoolSpec], clock: Callable[[], float]) -> LabRouter:
        workers = {model: [w.id for w in members] for model, members in fleet.by_model.items()}
        if name == "poolgate":
            return Poolgate(settings, pools, clock, seed, processes, exchange_s, siblings)
        if name == "least_request":
            return LeastRequest(workers, seed)
        if name == "power_of_two":
            return PowerOfTwo(workers, seed)
        if name == "cache_aware":
            return CacheAware(workers, seed)
        if name == "dynamo_kv":
            return DynamoKv(workers, seed, clock)
        if name == "oracle":
            return Oracle(fleet, seed)
        raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    return build


class Run:
    """One router over one fleet, with the trace's open-loop arrivals."""

    def __init__(self, fleet_name: str, requests: Sequence[LabRequest], make_router: RouterFactory,
                 seed: int) -> None:
        plans, self.pools = fleet_plans(fleet_name)
        self.loop = VirtualLoop()
        self.order = requests
        self.requests: dict[int, LabRequest] = {}
        """The requests that arrived, by index."""
        workers = {plan.id: LabWorker(plan, seed * 1000 + i) for i, plan in enumerate(plans)}
        self.fleet = LabFleet(self.loop, workers, self._step_done, self._events)
        self.router = make_router(self.fleet, self.pools, lambda: self.loop.now)
        self.outcome = Outcome()
        self._arrived: dict[int, float] = {}
        self._held: dict[int, float] = {}
        self._open = 0

    # -- drivers ------------------------------------------------------------------------------------------

    def open_loop(self, drain_s: float = DRAIN_LIMIT_S) -> Outcome:
        for request in self.order:
            self.loop.at(START_TIME + request.arrival_s, partial(self._arrive, request))
        self._open = len(self.order)
        last = START_TIME + max((r.arrival_s for r in self.order), default=0.0)
        self._tick()
        self.loop.run_until(lambda: self._open == 0 and self.loop.now > last, last + drain_s)
        return self.outcome

    # -- the request's life -------------------------------------------------------------------------------

    def _arrive(self, request: LabRequest) -> None:
        self.requests[request.index] = request
        self._arrived[request.index] = self.loop.now
        self._dispatch(request)

    def _dispatch(self, request: LabRequest) -> None:
        now = self.loop.now
        held_s = now - self._arrived[request.index]
        route = self.router.route(request, now, held_s)
        if route == HOLD:
            self._held[request.index] = now
            return
        self._held.pop(request.index, None)
        if route is None:
            self.outcome.refused.add(request.index)
            self._close()
            return
        self.outcome.worker_of[request.index] = route
        self.fleet.submit(route, request.engine)

    def _retry_held(self) -> None:
        for index in sorted(self._held, key=self._arrived.__getitem__):
            if index in self._held:
                self._dispatch(self.requests[index])

    def _step_done(self, worker: LabWorker, outcome: StepOutcome) -> None:
        now = self.loop.now
        for request_id, _ in outcome.first_token_times:
            index = int(request_id)
            self.outcome.ttft_s[index] = now - self._arrived[index]
            self.router.on_first_token(self.requests[index], worker.id, now)
        for finished in outcome.finished:
            index = int(finished.request_id)
            request = self.requests[index]
            self.outcome.e2e_s[index] = now - self._arrived[index]
            self.outcome.completed_at.append(now)
            if finished.reason == "error":
                self.outcome.failed.add(index)
            self.router.on_finished(request, worker.id, finished.output_tokens, now)
            self._close()
        if outcome.finished and self._held:
            self._retry_held()

    def _close(self) -> None:
        self._open -= 1

    def _events(self, worker_id: str, batch: Any) -> None:
        self.router.on_kv_events(worker_id, batch)

    def _tick(self) -> None:
        """The agent's scrape, and the held requests' periodic retry."""
        now = self.loop.now
        self.router.on_records(records_snapshot(self.fleet.records(), self.pools, now), now)
        if self._held:
            self._retry_held()
        if self._open:
            self.loop.at(now + SCRAPE_INTERVAL_S, self._tick)


# ---------------------------------------------------------------------------------------------- figures


def figures(requests: Sequence[LabRequest], run: Run) -> dict[str, Any]:
    outcome = run.outcome
    ttfts = [outcome.ttft_s.get(r.index, math.inf) if r.index not in outcome.failed else math.inf
             for r in requests]
    good = sum(1 for r, t in zip(requests, ttfts, strict=True) if t <= r.slo_ttft_s)
    workers = run.fleet.workers.values()
    queries = sum(w.prefix_cache_queries for w in workers)
    hits = sum(w.prefix_cache_hits for w in workers)
    spread: dict[str, int] = {w.id: 0 for w in workers}
    for worker_id in outcome.worker_of.values():
        spread[worker_id] += 1
    p99 = percentile(ttfts, 0.99)
    tail = sorted(r.arrival_s for r, t in zip(requests, ttfts, strict=True) if t >= p99)
    return {
        "requests": len(requests), "ttft_p50_s": percentile(ttfts, 0.50), "ttft_p99_s": p99,
        "tail_sent_s": [round(tail[0], 2), round(tail[-1], 2)] if tail else None,
        "goodput": good / len(requests) if requests else math.nan,
        "prefix_hit": hits / queries if queries else 0.0, "refused": len(outcome.refused),
        "failed": len(outcome.failed), "preempted": sum(w.preemptions for w in workers), "per_worker": spread,
    }


def capacity(fleet: str, scenario: str, seed: int, settings: SchedulingSettings, profiler: RequestProfiler,
             probes: int = CAPACITY_PROBES) -> float:
    """The highest arrival rate (requests per model second) least-request routing serves with ``SERVED_SHARE``
    of the requests' first tokens within ``SERVED_WITHIN_S``: bisection over Poisson traces of
    ``CAPACITY_WINDOW_S``. (A closed loop counts completions, which short requests dominate: on the mix it
    overstated the rate the fleet sustains by more than 3×.)"""
    low, high = 0.0, CAPACITY_CEILING_RPS
    tokeniser = Tokeniser()
    for _ in range(probes):
        rate = (low + high) / 2 if high < CAPACITY_CEILING_RPS else max(1.0, low * 2)
        trace = SCENARIOS[scenario].trace(rate, CAPACITY_WINDOW_S, seed, MODELS)
        requests = [lab_request(spec, body, profiler, tokeniser)
                    for spec, body in zip(trace.requests, trace.bodies, strict=True)]
        run = Run(fleet, requests, router_factory("least_request", seed, settings), seed)
        outcome = run.open_loop(drain_s=SERVED_WITHIN_S)
        served = sum(1 for r in requests if outcome.ttft_s.get(r.index, math.inf) <= SERVED_WITHIN_S)
        if served >= SERVED_SHARE * len(requests):
            low = rate
            if high >= CAPACITY_CEILING_RPS and rate * 2 >= CAPACITY_CEILING_RPS:
                high = rate * 2
        else:
            high = rate
    return low


@dataclass(frozen=True)
class CellSpec:
    fleet: str
    scenario: str
    bursty: bool
    level: float
    requests: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.fleet}/{self.scenario}/{'bursty' if self.bursty else 'poisson'}/{self.level:.0%}"


def run_cell(cell: CellSpec, routers: Iterable[tuple[str, RouterFactory]], rate: float,
             profiler: RequestProfiler) -> list[dict[str, Any]]:
    """The cell's trace (its seed's) through each router, on a fresh fleet each."""
    offered, seed = rate * cell.level, cell.seed
    trace = SCENARIOS[cell.scenario].trace(offered, cell.requests / offered, seed, MODELS, bursty=cell.bursty)
    requests = lab_requests(trace, profiler)
    of_cell = {"cell": cell.name, "seed": seed, "fleet": cell.fleet, "scenario": cell.scenario,
               "arrivals": "bursty" if cell.bursty else "poisson", "level": cell.level,
               "rate_per_s": round(rate * cell.level, 3)}
    rows = []
    for label, make in routers:
        started = time.perf_counter()
        run = Run(cell.fleet, requests, make, seed)
        run.open_loop()
        rows.append({**of_cell, "router": label, **figures(requests, run),
                     "wall_s": round(time.perf_counter() - started, 2)})
    started = time.perf_counter()
    plans, _ = fleet_plans(cell.fleet)
    presets: dict[str, set[str]] = {}
    for plan in plans:
        presets.setdefault(plan.model, set()).add(plan.preset)
    rows.append({**of_cell, "router": BOUND, "requests": len(requests), **bound_row_figures(requests, presets),
                 "tail_sent_s": None, "refused": 0, "failed": 0, "preempted": 0, "per_worker": {},
                 "wall_s": round(time.perf_counter() - started, 2)})
    return rows


# ---------------------------------------------------------------------------------------------- report


def _fmt(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.3f}"


def print_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    cell = None
    for row in rows:
        if (row["cell"], row["seed"]) != cell:
            cell = (row["cell"], row["seed"])
            print(f"\n{row['cell']}  (seed {row['seed']}: {row['requests']} requests at {row['rate_per_s']} req/s)",
                  flush=True)
            print(f"  {'router':<22} {'p50 s':>7} {'p99 s':>7} {'tail sent s':>13} {'goodput':>8} {'hit':>6} "
                  f"{'refused':>8} {'preempted':>9} {'spread':>16} {'wall s':>7}")
        spread = sorted(row["per_worker"].values()) or [0]
        tail = row["tail_sent_s"]
        print(f"  {row['router']:<22} {_fmt(row['ttft_p50_s']):>7} {_fmt(row['ttft_p99_s']):>7} "
              f"{'' if tail is None else f'{tail[0]:.2f}..{tail[1]:.2f}':>13} "
              f"{row['goodput']:>8.3f} {row['prefix_hit']:>6.3f} {row['refused']:>8} {row['preempted']:>9} "
              f"{f'{spread[0]}..{spread[-1]}':>16} {row['wall_s']:>7.1f}")


def over_seeds(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and router, over the seeds it ran with: the median, least and greatest p99, the median goodput,
    and for poolgate's rows the median of its p99 over the best peer's of the same trace (the oracle is not a
    peer): a ratio per trace, since a hard trace is hard for every router."""
    by_run: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        by_run.setdefault((row["cell"], row["seed"]), {})[row["router"]] = row
    grouped: dict[tuple[str, str], list[tuple[Mapping[str, Any], float]]] = {}
    for run in by_run.values():
        peers = [r["ttft_p99_s"] for name, r in run.items()
                 if not name.startswith("poolgate") and name not in ("oracle", BOUND)]
        best = min(peers, default=math.nan)
        for name, row in run.items():
            grouped.setdefault((row["cell"], name), []).append((row, row["ttft_p99_s"] / best if peers else math.nan))
    summary = []
    for (cell, router), runs in grouped.items():
        p99s = [row["ttft_p99_s"] for row, _ in runs]
        summary.append({
            "cell": cell, "router": router, "seeds": len(runs), "ttft_p99_s_median": statistics.median(p99s),
            "ttft_p99_s_min": min(p99s), "ttft_p99_s_max": max(p99s),
            "goodput_median": statistics.median(row["goodput"] for row, _ in runs),
            "p99_over_best_peer_median": (statistics.median(ratio for _, ratio in runs)
                                          if router.startswith("poolgate") or router == BOUND else None)})
    return summary


def print_summary(summary: Sequence[Mapping[str, Any]]) -> None:
    cell = None
    for row in summary:
        if row["cell"] != cell:
            cell = row["cell"]
            print(f"\n{cell}  (over {row['seeds']} traces)")
            print(f"  {'router':<22} {'p99 median':>10} {'min..max':>15} {'goodput':>8} {'x best peer':>11}")
        ratio = row["p99_over_best_peer_median"]
        print(f"  {row['router']:<22} {_fmt(row['ttft_p99_s_median']):>10} "
              f"{_fmt(row['ttft_p99_s_min']) + '..' + _fmt(row['ttft_p99_s_max']):>15} {row['goodput_median']:>8.3f} "
              f"{'' if ratio is None else f'{ratio:.2f}':>11}")


def plot(report: Mapping[str, Any], axis: Any) -> None:
    rows = [r for r in report["rows"] if r["level"] == TARGET_LEVEL and r["seed"] == report["parameters"]["seed"]]
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    routers = list(dict.fromkeys(r["router"] for r in rows))
    width = 0.8 / max(1, len(routers))
    for k, router in enumerate(routers):
        values = []
        for cell in cells:
            match = [r["ttft_p99_s"] for r in rows if r["cell"] == cell and r["router"] == router]
            values.append(min(match[0], 30.0) if match else 0.0)
        axis.bar([i + k * width for i in range(len(cells))], values, width, label=router)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    axis.set_xticklabels([c.replace("/", "\n", 2) for c in cells], fontsize=6)
    axis.set_ylabel("TTFT p99 (model s, capped at 30)")
    axis.set_yscale("log")
    axis.legend(fontsize="x-small")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="shared-docs on the L4 fleet at 85 %% only")
    parser.add_argument("--fleets", default=",".join(FLEETS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arrivals", default="poisson,bursty")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--levels", default=",".join(str(level) for level in LEVELS))
    parser.add_argument("--processes", default="1", help="poolgate's extproc processes, e.g. 1,2,4")
    parser.add_argument("--exchange-s", type=float, default=0.05,
                        help="how often poolgate's processes see each other's placements (model s)")
    parser.add_argument("--siblings", action="store_true",
                        help="with --processes above 1, also the processes as one host runs them: telling each "
                             "other every placement before the next pick (extproc.siblings)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="about this many requests per cell (the arrival window follows from the rate)")
    parser.add_argument("--calibrate", action="store_true",
                        help="search each fleet's capacity again and store it (else the stored one is used)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=SETTINGS",
                        help="also run poolgate with these scheduling settings, a JSON object "
                             '(e.g. \'latency={"weights": {"latency": 1}}\'); repeatable')
    parser.add_argument("--fleet-scale", type=int, default=1,
                        help="every fleet with this many times its workers, offered the base fleet's rates: each "
                             "request all but alone, with no queue (no floor: a spread-out cache computes more)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=1,
                        help="replay each cell with this many traces (seeds --seed, --seed + 1, …) and summarise "
                             "each router's p99 over them: a tail of a thousand requests moves with the trace")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells run in parallel processes")
    parser.add_argument("--name", default="lab", help="report name under bench/reports")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.fleets, args.scenarios, args.arrivals, args.levels = "l4", "shared-docs", "poisson", "0.85"
        args.requests = min(args.requests, 500)
    with host_quiet.measure() as quiet:
        rows, capacities, wall = sweep(args)
    summary = over_seeds(rows) if args.seeds > 1 else []
    if summary:
        print_summary(summary)
    print(f"\nlab wall time {wall:.0f} s")
    write_report(args.name, {"name": args.name, "parameters": {**vars(args), "capacities": capacities,
                                                               "wall_s": round(wall, 1)},
                             "rows": rows, "over_seeds": summary}, plot, host=quiet.stop())
    return 0


def routers_of(args: argparse.Namespace, seed: int) -> list[tuple[str, RouterFactory]]:
    """The routers the arguments name: poolgate (and each ``--variant``) at each ``--processes``, the others."""
    settings = SchedulingSettings()
    variants = [("poolgate", settings)]
    for variant in args.variant:
        label, _, section = variant.partition("=")
        variants.append((f"poolgate:{label}", PLUGINS.settings(orjson.loads(section))))
    routers: list[tuple[str, RouterFactory]] = []
    for name in args.routers.split(","):
        if name == "poolgate":
            for label, variant_settings in variants:
                for processes in (int(p) for p in args.processes.split(",")):
                    routers.append((label if processes == 1 else f"{label}×{processes}",
                                    router_factory(name, seed, variant_settings, processes, args.exchange_s)))
                    if processes > 1 and args.siblings:
                        routers.append((f"{label}×{processes} siblings", router_factory(
                            name, seed, variant_settings, processes, args.exchange_s, siblings=True)))
        else:
            routers.append((name, router_factory(name, seed, settings)))
    return routers


def cell_rows(cell: CellSpec, rate: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One cell, every router of the arguments (a function of its arguments alone: it runs in a worker
    process of the sweep)."""
    return run_cell(cell, routers_of(args, cell.seed), rate, RequestProfiler(SchedulingSettings()))


def sweep(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """Every cell the arguments name, each router of them on it, cells spread over ``--jobs`` processes (each
    cell is deterministic, so the rows do not depend on how many): the rows, the capacities used, the wall
    time."""
    started = time.perf_counter()
    settings = SchedulingSettings()
    profiler = RequestProfiler(settings)
    routers_of(args, args.seed)  # a bad --variant or router name fails here, before any cell runs
    capacities: dict[str, float] = {}
    stored = json.loads(CAPACITY_FILE.read_text()) if CAPACITY_FILE.exists() else {}
    cells: list[tuple[CellSpec, float]] = []
    for fleet in args.fleets.split(","):
        for scenario in args.scenarios.split(","):
            key = f"{fleet}/{scenario}/{args.seed}"
            if args.calibrate or key not in stored:
                stored[key] = round(capacity(fleet, scenario, args.seed, settings, profiler), 3)
                CAPACITY_FILE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
            rate = capacities[key] = stored[key]
            for arrivals in args.arrivals.split(","):
                for level in (float(x) for x in args.levels.split(",")):
                    for seed in range(args.seed, args.seed + args.seeds):
                        cells.append((CellSpec(scaled_fleet(fleet, args.fleet_scale), scenario, arrivals == "bursty",
                                               level, args.requests, seed), rate))
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for cell_result in pool.map(cell_rows, *zip(*cells, strict=True), [args] * len(cells)):
            print_rows(cell_result)
            rows.extend(cell_result)
    return rows, capacities, time.perf_counter() - started


if __name__ == "__main__":
    raise SystemExit(main())
