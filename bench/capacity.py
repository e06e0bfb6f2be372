"""Find a fleet's capacity for one scenario: a closed-loop sweep until throughput stops growing.

Each step runs ``clients`` closed-loop clients through Envoy ``least_request`` (no router knowledge) over
the scenario's requests; after a warm-up it counts requests completed per model second (first tokens
would overcount: with more clients than the fleet holds, the queued backlog is admitted inside the
window at no higher service rate); then it doubles the clients. The sweep stops when a step gains
less than ``min_gain`` over the best so far (or after ``max_steps``); capacity is the best step's rate.
The warm-up must outlast a typical request on the fast workers (answers of a few hundred tokens take
seconds); requests that outlast the window on slow workers make the figure a slight underestimate. The
best step's tokens generated per worker (the workers' own counters) are each worker's measured capacity,
from which the weighted Envoy baseline takes its weights. Requests go in trace order (a session's turns
stay in order); prefix caches are reset before every step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.loadgen import Counters, run_closed_loop
from bench.measure import Scrapes, counter_delta, worker_figures
from bench.replay import Progress, with_progress
from bench.scenarios import Trace
from bench.sched_fleet import BenchFleet

GENERATED = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class SweepPlan:
    clients_per_worker: int
    """The first step's clients per worker of the fleet; each later step doubles them."""
    warmup_s: float
    window_s: float
    """Wall seconds."""
    max_steps: int = 5
    min_gain: float = 0.05


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
    completed = sum(o.completed and o.e2e_s is not None
                    and plan.warmup_s <= o.sent_s + o.e2e_s < plan.warmup_s + plan.window_s for o in outcomes)
    return {"clients": clients, "tokens_per_s": counter_delta(before, after, GENERATED) / model_s,
            "admissions_per_s": admitted / model_s, "completions_per_s": completed / model_s,
            "errors": sum(o.error is not None for o in outcomes),
            "worker_generation_tokens": worker_figures(before, after)["worker_generation_tokens"]}


async def sweep_capacity(session: aiohttp.ClientSession, fleet: BenchFleet, trace: Trace, plan: SweepPlan,
                         progress: Progress, label: str) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    first_clients = clients = plan.clients_per_worker * len(fleet.workers)
    saturated = False
    for _ in range(plan.max_steps):
        steps.append(await _step(session, fleet, trace, plan, clients, progress, label))
        best_before = max((s["completions_per_s"] for s in steps[:-1]), default=0.0)
        if best_before and steps[-1]["completions_per_s"] < best_before * (1 + plan.min_gain):
            saturated = True
            break
        clients *= 2
    await fleet.wait_idle(session)
    progress.step()
    best = max(steps, key=lambda s: s["completions_per_s"])
    return {
        "rps": best["completions_per_s"], "tokens_per_s": best["tokens_per_s"], "clients": best["clients"],
        "steps": steps, "saturated": saturated,
        "worker_generation_tokens": best["worker_generation_tokens"],
        "method": (f"closed loop through Envoy least_request over the scenario's requests, clients doubled from "
                   f"{first_clients} until completed requests per second grew by less than "
                   f"{plan.min_gain:.0%} (each step {plan.warmup_s * fleet.time_scale:.1f} s of warm-up, then "
                   f"{plan.window_s * fleet.time_scale:.1f} s counted, model time)"),
    }


def pools_of(fleet: BenchFleet) -> dict[str, list[str]]:
    """Pool name → its worker ids."""
    pools: dict[str, list[str]] = {}
    for worker in fleet.workers:
        pools.setdefault(worker.pool, []).append(worker.id)
    return pools
