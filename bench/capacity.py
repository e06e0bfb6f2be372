"""Find a fleet's capacity for one scenario: a closed-loop sweep until throughput stops growing.

Each step runs ``clients`` closed-loop clients through Envoy ``least_request`` (no router knowledge) over
the scenario's requests and measures the tokens the workers generate per model second (their own
counters) after a warm-up, then doubles the clients; the sweep stops when a step gains less than
``min_gain`` over the best so far (or after ``max_steps``). Token throughput settles within seconds even
when single answers take tens of seconds, which a count of finished requests would not.

Capacity in requests/s = best tokens/s ÷ the scenario's mean answer length. The workers are simulated, so
the benchmark knows each request's answer length exactly (the simulated model's seeded natural length,
capped by ``max_tokens``: ``simworker.protocol.plan_generation``); no router is told. The best step's
tokens per worker are each worker's measured capacity, from which the weighted Envoy baseline takes its
weights. Requests go in trace order (a session's turns stay in order); prefix caches are reset before
every step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.loadgen import Counters, run_closed_loop
from bench.measure import Scrapes, counter_delta, worker_figures
from bench.replay import Progress, with_progress
from bench.scenarios import Trace
from bench.sched_fleet import MODELS, POOL_MAX_MODEL_LEN, POOL_OF_ROLE, BenchFleet
from simworker import protocol

GENERATED = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class SweepPlan:
    first_clients: int
    warmup_s: float
    window_s: float
    """Wall seconds."""
    max_steps: int = 5
    min_gain: float = 0.05


def answer_tokens(trace: Trace) -> list[int]:
    """Each request's answer length as the simulated model will give it."""
    lengths = []
    for spec, raw in zip(trace.requests, trace.bodies, strict=True):
        body = orjson.loads(raw)
        parse = protocol.parse_chat if "messages" in body else protocol.parse_completion
        plan = protocol.plan_generation(parse(body), POOL_MAX_MODEL_LEN[POOL_OF_ROLE[spec.role]],
                                        MODELS[spec.role])
        lengths.append(plan.output_target)
    return lengths


async def _scrape_window(session: aiohttp.ClientSession, fleet: BenchFleet, warmup_s: float,
                         window_s: float) -> tuple[Scrapes, Scrapes]:
    await asyncio.sleep(warmup_s)
    start = await fleet.scrape_all(session)
    await asyncio.sleep(window_s)
    return start, await fleet.scrape_all(session)


async def _step(session: aiohttp.ClientSession, fleet: BenchFleet, trace: Trace, plan: SweepPlan, clients: int,
                progress: Progress, label: str) -> dict[str, Any]:
    await fleet.wait_idle(session)
    await fleet.reset_prefix_caches(session)
    counters = Counters()
    load = asyncio.ensure_future(run_closed_loop(
        session, fleet.target("least_request"), trace.requests, trace.bodies, concurrency=clients,
        warmup_s=plan.warmup_s, window_s=plan.window_s + 0.5, counters=counters))
    window = asyncio.ensure_future(_scrape_window(session, fleet, plan.warmup_s, plan.window_s))
    admitted, outcomes = await with_progress(progress, f"capacity {label} ×{clients}", counters, 0, load)
    before, after = await window
    model_s = plan.window_s * fleet.time_scale
    return {"clients": clients, "tokens_per_s": counter_delta(before, after, GENERATED) / model_s,
            "admissions_per_s": admitted / model_s, "errors": sum(o.error is not None for o in outcomes),
            "worker_generation_tokens": worker_figures(before, after)["worker_generation_tokens"]}


async def sweep_capacity(session: aiohttp.ClientSession, fleet: BenchFleet, trace: Trace, plan: SweepPlan,
                         progress: Progress, label: str) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    clients = plan.first_clients
    for _ in range(plan.max_steps):
        steps.append(await _step(session, fleet, trace, plan, clients, progress, label))
        best_before = max((s["tokens_per_s"] for s in steps[:-1]), default=0.0)
        if best_before and steps[-1]["tokens_per_s"] < best_before * (1 + plan.min_gain):
            break
        clients *= 2
    await fleet.wait_idle(session)
    progress.step()
    best = max(steps, key=lambda s: s["tokens_per_s"])
    lengths = answer_tokens(trace)
    mean_answer = sum(lengths) / len(lengths)
    return {
        "rps": best["tokens_per_s"] / mean_answer, "tokens_per_s": best["tokens_per_s"],
        "mean_answer_tokens": mean_answer, "clients": best["clients"], "steps": steps,
        "worker_generation_tokens": best["worker_generation_tokens"],
        "method": (f"closed loop through Envoy least_request over the scenario's requests, clients doubled from "
                   f"{plan.first_clients} until the workers' generated tokens per second grew by less than "
                   f"{plan.min_gain:.0%} (each step {plan.warmup_s * fleet.time_scale:.1f} s of warm-up, then "
                   f"{plan.window_s * fleet.time_scale:.1f} s counted, model time); capacity = best tokens/s ÷ "
                   f"mean answer ({mean_answer:.0f} tokens)"),
    }


def pools_of(fleet: BenchFleet) -> dict[str, list[str]]:
    """Pool name → its worker ids."""
    pools: dict[str, list[str]] = {}
    for worker in fleet.workers:
        pools.setdefault(worker.pool, []).append(worker.id)
    return pools
