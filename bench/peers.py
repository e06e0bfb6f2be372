"""poolgate against the routers users would pick instead, on production-shaped traffic.

    poolgate bench peers --out DIR [--quick] [--no-peers]
    python bench/peers.py --out DIR [--quick]

1. Install ``vllm-router`` and ``sglang-router`` (pinned, from PyPI) into the benchmark's own venv
   (``peer_install``; skipped with ``--no-peers``).
2. Per fleet (``sched_fleet.LAYOUTS``): start the simulated workers, poolgate's stack and a baseline Envoy.
3. Per scenario (``scenarios``): sweep the capacity (``capacity``: closed loop until throughput stops
   growing), weight the weighted least_request baseline by each worker's measured capacity.
4. Per arrival pattern and load level: one seeded trace, replayed through every router (``routers``) in an
   order shuffled by the seed and printed; before each router the fleet is idle and its prefix caches reset,
   and poolgate's extproc processes start afresh and follow every worker's KV events before its run.
5. Write DIR/report.json, DIR/report.md, DIR/ttft_cdf.png and DIR/goodput_vs_load.png; print the targets
   (met / missed with the figures) and the wall time.

The full run (about an hour on two cores): poolgate, weighted least_request and both cache-aware peers on
every scenario × both fleets at 85 % with Poisson arrivals, and with on/off bursts on the heterogeneous
fleet; every router and the 50 / 85 / 100 % sweep on ``shared-docs`` (heterogeneous fleet, Poisson); the
oracle (the worker really holding the longest cached prefix, ``routers``) at 85 % on ``shared-docs`` and
``sessions``, the reference of poolgate's prefix-cache hit rate.
``--capacity-from REPORT_JSON`` takes the capacities an earlier run measured instead of sweeping them: runs that
take them with the same arguments replay the same traces (one extproc process against two, say), that run's
too where the windows are its own.
``--quick`` (about 7 minutes): ``shared-docs`` on the heterogeneous fleet at 85 %, poolgate, weighted
least_request, one cache-aware router of each peer project and the oracle, at least 110 requests per router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from bench import host_quiet
from bench.capacity import SweepPlan, pools_of, sweep_capacity
from bench.loadgen import new_session
from bench.peer_install import PeerVenv, default_venv_dir, ensure_peers
from bench.peers_report import evaluate_targets, markdown, write_outputs
from bench.replay import Progress, Window, replay
from bench.report import parse_out_args
from bench.routers import ALL_ROUTERS, ORACLE, PEER_ROUTERS, capacity_weights, make_router
from bench.scenarios import SCENARIOS, Scenario
from bench.sched_fleet import LAYOUTS, MODELS, BenchFleet

MAIN_ROUTERS = ("poolgate", "least_request_weighted", "vllm-router:cache_aware", "sglang-router:cache_aware")
ORACLE_SCENARIOS = ("shared-docs", "sessions")
"""Cells where the oracle (``routers.OracleRouter``) also runs, at 85 % only: the prefix-cache reference."""
SWEEP_LEVELS = (0.5, 0.85, 1.0)
TARGET_LEVEL = 0.85
MAX_WINDOW_FACTOR = 2.0


@dataclass(frozen=True)
class Plan:
    time_scale: float
    window: Window
    sweep: SweepPlan
    fleets: tuple[str, ...]
    scenarios: tuple[str, ...]
    arrivals: tuple[str, ...]
    routers: tuple[str, ...]
    sweep_scenario: str | None
    """Every router and every level of ``levels`` run here (first fleet only); elsewhere ``routers`` at 85 %."""
    sweep_routers: tuple[str, ...]
    levels: tuple[float, ...]
    seed: int
    agent_wait_s: float
    min_requests: int
    """The arrival window grows (up to ``MAX_WINDOW_FACTOR`` ×) until a trace holds about this many requests."""
    extproc_processes: int | None = None
    """poolgate's extproc processes (None: one per core, the default)."""
    oracle: bool = True
    """Also run the oracle on ``ORACLE_SCENARIOS`` at 85 % (its prefix-cache hit rate is the reference)."""
    capacity_from: str | None = None
    """An earlier run's report.json whose measured capacities this run takes instead of sweeping its own."""
    reused: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Those capacities by ``fleet/scenario``: runs that take them with the same arguments replay the same traces."""


@dataclass(frozen=True)
class Cell:
    fleet: str
    scenario: Scenario
    arrivals: str
    levels: tuple[float, ...]
    routers: tuple[str, ...]


def cells_of(plan: Plan, fleet: str) -> list[Cell]:
    cells = []
    for name in plan.scenarios:
        swept = name == plan.sweep_scenario and fleet == plan.fleets[0]
        for arrivals in plan.arrivals:
            if arrivals != plan.arrivals[0] and fleet != plan.fleets[0]:
                continue  # later arrival patterns on the first fleet only: the hour holds no more
            sweep_here = swept and arrivals == plan.arrivals[0]
            levels = plan.levels if sweep_here else (TARGET_LEVEL,)
            routers = plan.sweep_routers if sweep_here else plan.routers
            if plan.oracle and name in ORACLE_SCENARIOS and ORACLE not in routers:
                routers = (*routers, ORACLE)
            cells.append(Cell(fleet, SCENARIOS[name], arrivals, levels, routers))
    return cells


def router_order(routers: Sequence[str], seed: int, cell: str) -> list[str]:
    """The routers in an order shuffled by the seed, differently in each cell (a string seed is hashed
    the same way in every process)."""
    order = list(routers)
    random.Random(f"{seed}:{cell}").shuffle(order)
    return order


def window_for(plan: Plan, offered_rps: float) -> Window:
    """The plan's window, longer where the rate is low, so that p99 rests on enough requests."""
    wanted_s = plan.min_requests / offered_rps / plan.time_scale
    window_s = min(max(plan.window.window_s, wanted_s), MAX_WINDOW_FACTOR * plan.window.window_s)
    return Window(plan.time_scale, window_s, plan.window.drain_s)


def capacity_line(capacity: dict[str, Any]) -> str:
    steps = ", ".join(f"×{s['clients']} {s['completions_per_s']:.2f}" for s in capacity["steps"])
    end = "throughput stopped growing" if capacity["saturated"] else "still growing at the last step"
    return f"{capacity['rps']:.2f} req/s (steps: {steps} req/s; {end})"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


async def run_cell(session: aiohttp.ClientSession, fleet: BenchFleet, cell: Cell, plan: Plan, venv: PeerVenv | None,
                   capacity: dict[str, Any], progress: Progress,
                   run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    order = router_order(cell.routers, plan.seed, f"{cell.fleet}/{cell.scenario.name}/{cell.arrivals}")
    progress.note(f"{cell.fleet} · {cell.scenario.name} · {cell.arrivals}: router order {', '.join(order)}")
    class_names = [c.name for c in cell.scenario.classes]
    for level_index, level in enumerate(cell.levels):
        offered = level * capacity["rps"]
        window = window_for(plan, offered)
        trace = cell.scenario.trace(offered, window.window_s * plan.time_scale, plan.seed * 100 + level_index,
                                    MODELS, bursty=cell.arrivals == "bursty")
        for name in order:
            if name == ORACLE and not math.isclose(level, TARGET_LEVEL):
                continue
            await fleet.wait_idle(session)
            await fleet.reset_prefix_caches(session)
            router = make_router(name, fleet, venv, cell.scenario.roles, run_dir)
            try:
                target = await router.start(session)
                row = await replay(session, fleet, target, level, offered, trace.requests, trace.bodies, window,
                                   class_names, progress, f"{cell.scenario.name} {cell.arrivals} {level:.0%} {name}")
            finally:
                await router.stop()
            rows.append({"fleet": cell.fleet, "scenario": cell.scenario.name, "arrivals": cell.arrivals, **row})
    summary = {"fleet": cell.fleet, "scenario": cell.scenario.name, "arrivals": cell.arrivals, "order": order,
               "capacity_rps": capacity["rps"], "capacity": capacity_line(capacity), "weights": fleet.baseline_weights}
    return summary, rows


async def run_fleet(session: aiohttp.ClientSession, layout: str, plan: Plan, venv: PeerVenv | None,
                    progress: Progress, report: dict[str, Any], out: Path, quiet: host_quiet.Sampler) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix=f"poolgate-bench-peers-{layout}-"))
    report["logs"].append(str(run_dir))
    fleet = BenchFleet(run_dir, plan.time_scale, LAYOUTS[layout], plan.extproc_processes)
    try:
        progress.show(f"starting the {layout} fleet")
        await fleet.start(session)
        await fleet.check_baseline(session)
        report["agent_data"][layout] = await fleet.ensure_agent(plan.agent_wait_s)
        capacities: dict[str, dict[str, Any]] = {}
        for cell in cells_of(plan, layout):
            name = cell.scenario.name
            if name not in capacities:
                reused = plan.reused.get(f"{layout}/{name}")
                if reused is None:
                    pool = cell.scenario.trace(5.0, 240.0, plan.seed * 7 + 1, MODELS)
                    capacities[name] = await sweep_capacity(session, fleet, pool, plan.sweep, progress,
                                                            f"{layout} {name}")
                else:
                    capacities[name] = {**reused, "taken_from": plan.capacity_from}
                await fleet.restart_baseline(session, capacity_weights(
                    capacities[name]["worker_generation_tokens"], pools_of(fleet)))
                report["capacity"].append({"fleet": layout, "scenario": name, **capacities[name]})
                progress.note(f"capacity {layout} {name}: {capacity_line(capacities[name])}")
            summary, rows = await run_cell(session, fleet, cell, plan, venv, capacities[name], progress, run_dir)
            report["cells"].append(summary)
            report["rows"].extend(rows)
            checkpoint(out, report, quiet)
    finally:
        await fleet.stop()


def phases(plan: Plan) -> int:
    total = 0
    for fleet in plan.fleets:
        cells = cells_of(plan, fleet)
        total += len({c.scenario.name for c in cells}) + sum(len(c.levels) * len(c.routers) for c in cells)
    return total


def checkpoint(out: Path, report: dict[str, Any], quiet: host_quiet.Sampler) -> None:
    """Write the report as it stands (after each cell, and at the end whatever happened), with the host's
    quiet so far."""
    report["wall_s"] = time.monotonic() - report["started"]
    report["targets"] = evaluate_targets(report["rows"])
    write_outputs(out, report, quiet.summary())


async def run(plan: Plan, venv: PeerVenv | None, out: Path, quiet: host_quiet.Sampler) -> dict[str, Any]:
    report: dict[str, Any] = {
        "name": "peers", "commit": git_commit(), "time_scale": plan.time_scale, "seed": plan.seed,
        "window_model_s": plan.window.window_s * plan.time_scale,
        "drain_model_s": plan.window.drain_s * plan.time_scale,
        "peers": ", ".join(f"{n} {v}" for n, v in venv.versions.items()) if venv else "not run (--no-peers)",
        "fleets": {name: LAYOUTS[name].describe() for name in plan.fleets},
        "scenarios": {name: SCENARIOS[name].summary for name in plan.scenarios},
        "plan": {k: v for k, v in plan.__dict__.items() if k not in ("window", "sweep", "reused")},
        "agent_data": {}, "capacity": [], "cells": [], "rows": [], "logs": [], "started": time.monotonic(),
    }
    progress = Progress(phases(plan))
    async with new_session() as session:
        try:
            for layout in plan.fleets:
                await run_fleet(session, layout, plan, venv, progress, report, out, quiet)
        finally:
            progress.close()
            checkpoint(out, report, quiet)
    return report


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    peers = () if args.no_peers else PEER_ROUTERS
    main_routers = tuple(r for r in MAIN_ROUTERS if r not in PEER_ROUTERS or r in peers)
    plan = Plan(
        time_scale=args.time_scale,
        window=Window(args.time_scale, args.window_s or (40.0 if quick else 30.0), args.drain_s or 6.0),
        sweep=SweepPlan(clients_per_worker=12, warmup_s=14.0, window_s=14.0, max_steps=3),
        min_requests=args.min_requests,
        fleets=tuple(args.fleets or (["heterogeneous"] if quick else list(LAYOUTS))),
        scenarios=tuple(args.scenarios or (["shared-docs"] if quick else list(SCENARIOS))),
        arrivals=tuple(args.arrivals or (["poisson"] if quick else ["poisson", "bursty"])),
        routers=tuple(args.routers or main_routers),
        sweep_scenario=None if quick else args.sweep_scenario,
        sweep_routers=tuple(args.routers or (r for r in ALL_ROUTERS if (r not in PEER_ROUTERS or r in peers)
                                             and r != ORACLE)),
        levels=tuple(args.levels),
        seed=args.seed,
        agent_wait_s=8.0 if quick else 20.0,
        oracle=not args.no_oracle,
        extproc_processes=args.extproc_processes,
        capacity_from=str(args.capacity_from) if args.capacity_from else None,
    )
    return replace(plan, reused=reused_capacities(args.capacity_from, plan)) if args.capacity_from else plan


def reused_capacities(path: Path, plan: Plan) -> dict[str, dict[str, Any]]:
    """The capacities an earlier run measured, by ``fleet/scenario``. They are the capacities of this run's fleet
    only at the same time scale, and only with the same seed the same traces follow from them: anything else is
    refused. (Runs that take them with the same windows replay the same traces; that run's too, with its
    windows.)"""
    earlier = json.loads(path.read_text())
    differs = [f"{key} {earlier.get(key)} there, {mine} here"
               for key, mine in (("seed", plan.seed), ("time_scale", plan.time_scale))
               if not (isinstance(earlier.get(key), (int, float)) and math.isclose(earlier[key], mine))]
    if differs:
        raise SystemExit(f"--capacity-from {path}: not this run's fleet and traces ({'; '.join(differs)})")
    return {f"{c['fleet']}/{c['scenario']}": {k: v for k, v in c.items() if k not in ("fleet", "scenario")}
            for c in earlier.get("capacity", [])}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for report.json, report.md and the PNGs")
    parser.add_argument("--quick", action="store_true", help="one scenario, one fleet, 85 %% (a few minutes)")
    parser.add_argument("--no-peers", action="store_true", help="skip vllm-router and sglang-router")
    parser.add_argument("--no-oracle", action="store_true",
                        help="skip the oracle router (the prefix-cache reference on shared-docs and sessions)")
    parser.add_argument("--peers-venv", type=Path, default=None,
                        help="virtualenv for the peers (default: under the user cache folder)")
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="simulated GPU speed versus real time (default %(default)s: 2× slower)")
    parser.add_argument("--window-s", type=float, help="arrival window per router and level, wall seconds")
    parser.add_argument("--drain-s", type=float, help="longest wait for first tokens after the window, wall s")
    parser.add_argument("--fleets", nargs="+", choices=sorted(LAYOUTS))
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--arrivals", nargs="+", choices=("poisson", "bursty"),
                        help="arrival patterns; the second and later run on the first fleet only "
                             "(default: poisson bursty, --quick poisson)")
    parser.add_argument("--routers", nargs="+", choices=ALL_ROUTERS, help="routers of every cell")
    parser.add_argument("--sweep-scenario", default="shared-docs", choices=sorted(SCENARIOS),
                        help="scenario run with every router at every level (default %(default)s)")
    parser.add_argument("--levels", type=float, nargs="+", default=list(SWEEP_LEVELS),
                        help="shares of capacity of the sweep")
    parser.add_argument("--min-requests", type=int, default=110,
                        help="lengthen a cell's window towards this many requests per router (default %(default)s)")
    parser.add_argument("--extproc-processes", type=int, help="poolgate's extproc processes (default: one per core)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--capacity-from", type=Path, metavar="REPORT_JSON",
                        help="take the capacities an earlier run's report.json measured instead of sweeping them "
                             "(same seed and time scale): runs with the same arguments replay the same traces, "
                             "e.g. to compare one extproc process with two")


def main(argv: Sequence[str] | None = None) -> int:
    args, out = parse_out_args(__doc__, add_arguments, argv)
    plan = make_plan(args)
    venv = None
    with host_quiet.measure() as quiet:  # before the peers' install: "load before" means nothing started
        if not args.no_peers:
            print("installing the peer routers (pip, into their own venv)…", file=sys.stderr, flush=True)
            venv = ensure_peers(args.peers_venv or default_venv_dir(), out / "peers-install.log")
        report = asyncio.run(run(plan, venv, out, quiet))
    report = host_quiet.attach(report, quiet.stop())
    print(markdown(report))
    print(f"peers benchmark took {report['wall_s'] / 60:.1f} min (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
