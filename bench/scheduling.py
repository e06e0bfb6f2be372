"""Scheduling policies compared on one simulated fleet: poolgate vs Envoy round_robin, least_request, random.

    poolgate bench scheduling --out DIR [--quick]
    python bench/scheduling.py --out DIR [--quick]

1. Start the fleet (``sched_fleet``: ten simulated workers of two models and two GPU sizes, poolgate's
   stack, and a baseline Envoy without ext_proc in front of the same workers).
2. Measure capacity: closed loop through Envoy ``least_request`` with enough clients to keep every
   worker's queue non-empty; capacity = first tokens (admissions) per model second after a warm-up, in
   requests/s of the mix.
3. For each load level (50, 85, 100 % of capacity): one seeded Poisson trace of the mix (``workload``),
   replayed through each policy from an idle fleet (all workers report 0 running, 0 waiting).
4. Write DIR/report.json, DIR/report.md and DIR/report.png (TTFT CDFs per level), and say per target
   whether poolgate met it against least_request at 85 %.

Two cores run the client, both Envoys, extproc, the controller and ten engines, so the engines run
``--time-scale`` times real speed (below 1: slower than a real GPU), which keeps the events per wall second
low enough for the host. The report gives its health: arrival lateness and the simulator's step lag.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from bench import host_quiet
from bench.loadgen import Counters, new_session, run_closed_loop
from bench.replay import Progress, Window, replay, with_progress
from bench.report import parse_out_args
from bench.sched_fleet import MODELS, BenchFleet
from bench.sched_report import evaluate_targets, write_outputs
from bench.workload import MIX, RequestSpec, draw_request, poisson_trace, request_body

POLICIES = ("poolgate", "round_robin", "least_request", "random")
LEVELS = (0.5, 0.85, 1.0)


@dataclass(frozen=True)
class Plan:
    """Durations in wall seconds (the report converts to model time)."""

    time_scale: float
    window_s: float
    drain_s: float
    capacity_warmup_s: float
    capacity_window_s: float
    capacity_clients: int
    capacity_rps: float | None
    """Skip the measurement and use this capacity (requests/s of the mix, model time)."""
    agent_wait_s: float
    levels: tuple[float, ...]
    policies: tuple[str, ...]
    seed: int


async def measure_capacity(session: aiohttp.ClientSession, fleet: BenchFleet, plan: Plan,
                           progress: Progress) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    requests = [draw_request(rng, i, 0.0) for i in range(1500)]
    bodies = [request_body(r, MODELS[r.role]) for r in requests]
    counters = Counters()
    await fleet.wait_idle(session)
    busy_before = await fleet.scrape_all(session)
    work = asyncio.ensure_future(run_closed_loop(
        session, fleet.target("least_request"), requests, bodies, concurrency=plan.capacity_clients,
        warmup_s=plan.capacity_warmup_s, window_s=plan.capacity_window_s, counters=counters))
    admitted, outcomes = await with_progress(progress, "capacity (least_request)", counters, 0, work)
    busy_after = await fleet.scrape_all(session)
    await fleet.wait_idle(session)
    progress.step()
    model_window = plan.capacity_window_s * plan.time_scale
    rps = admitted / model_window
    return {
        "rps": rps,
        "method": (f"closed loop through Envoy least_request, {plan.capacity_clients} concurrent clients drawing "
                   f"from the same mix; first tokens (admissions) counted over {model_window:.1f} s (model) "
                   f"after a {plan.capacity_warmup_s * plan.time_scale:.1f} s warm-up."),
        "clients": plan.capacity_clients, "admitted": admitted,
        "errors": sum(o.error is not None for o in outcomes),
        "preemptions": int(sum(busy_after[w]["vllm:num_preemptions_total"]
                               - busy_before[w]["vllm:num_preemptions_total"] for w in busy_after)),
        "output_tokens_per_s": counters.window_tokens / ((plan.capacity_warmup_s + plan.capacity_window_s)
                                                         * plan.time_scale),
    }


async def run_policy(session: aiohttp.ClientSession, fleet: BenchFleet, plan: Plan, policy: str, level: float,
                     offered_rps: float, trace: Sequence[RequestSpec], bodies: Sequence[bytes],
                     progress: Progress) -> dict[str, Any]:
    window = Window(plan.time_scale, plan.window_s, plan.drain_s)
    return await replay(session, fleet, fleet.target(policy), level, offered_rps, trace, bodies, window,
                        [c.name for c in MIX], progress, f"{level:.0%} {policy}")


async def run(plan: Plan, out: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-bench-scheduling-"))
    fleet = BenchFleet(run_dir, plan.time_scale)
    progress = Progress(1 + len(plan.levels) * len(plan.policies))
    rows: list[dict[str, Any]] = []
    async with new_session() as session:
        try:
            progress.show("starting the fleet")
            await fleet.start(session)
            await fleet.check_baseline(session)
            progress.show("waiting for agent data")
            agent_data = await fleet.ensure_agent(plan.agent_wait_s)
            if plan.capacity_rps is None:
                capacity = await measure_capacity(session, fleet, plan, progress)
            else:
                capacity = {"rps": plan.capacity_rps, "method": "given on the command line (--capacity-rps)"}
                progress.step()
            for level_index, level in enumerate(plan.levels):
                offered = level * capacity["rps"]
                trace = poisson_trace(offered, plan.window_s * plan.time_scale, seed=plan.seed * 100 + level_index)
                bodies = [request_body(r, MODELS[r.role]) for r in trace]
                for policy in plan.policies:
                    rows.append(await run_policy(session, fleet, plan, policy, level, offered, trace, bodies,
                                                 progress))
        finally:
            progress.close()
            await fleet.stop()
    return {
        "name": "scheduling",
        "fleet": ", ".join(f"{w.id} ({w.preset})" for w in fleet.workers),
        "models": MODELS,
        "time_scale": plan.time_scale,
        "window_model_s": plan.window_s * plan.time_scale,
        "drain_model_s": plan.drain_s * plan.time_scale,
        "plan": plan.__dict__,
        "agent_data": agent_data,
        "capacity": capacity,
        "rows": rows,
        "targets": evaluate_targets(rows),
        "logs": str(run_dir),
    }


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    return Plan(
        time_scale=args.time_scale,
        window_s=args.window_s or (7.0 if quick else 45.0),
        drain_s=args.drain_s or (3.0 if quick else 12.0),
        capacity_warmup_s=4.0 if quick else 20.0,
        capacity_window_s=8.0 if quick else 30.0,
        capacity_rps=args.capacity_rps,
        capacity_clients=args.capacity_clients,
        agent_wait_s=8.0 if quick else 20.0,
        levels=tuple(args.levels),
        policies=tuple(args.policies),
        seed=args.seed,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for report.json, report.md and report.png")
    parser.add_argument("--quick", action="store_true", help="short windows (about 3 minutes in all)")
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="simulated GPU speed versus real time (default %(default)s: 2× slower)")
    parser.add_argument("--window-s", type=float, help="arrival window per policy and level, wall seconds")
    parser.add_argument("--drain-s", type=float, help="longest wait for first tokens after the window, wall s")
    parser.add_argument("--capacity-clients", type=int, default=96, help="closed-loop clients (default %(default)s)")
    parser.add_argument("--capacity-rps", type=float,
                        help="use this capacity (requests/s, model time) instead of measuring it")
    parser.add_argument("--levels", type=float, nargs="+", default=list(LEVELS), help="shares of capacity")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--seed", type=int, default=7)


def main(argv: Sequence[str] | None = None) -> int:
    args, out = parse_out_args(__doc__, add_arguments, argv)
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(make_plan(args), out))
    write_outputs(out, report, quiet.stop())
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
