"""Prefill/decode disaggregation against the aggregated fleet, same GPUs, on the peers benchmark's ``mix``.

    poolgate bench disagg --out DIR [--rate R] [--window-s S]
    python bench/disagg.py --out DIR

The ``mix`` scenario (``scenarios``: chat, code completion, 8–16k-token summarisations, long streams) is
replayed, one seeded trace, through poolgate on two fleets of four simulated H100s (``sched_fleet``):
``homogeneous`` (chat 3, code 1) and ``DISAGGREGATED`` (chat 1 prefill + 2 decode, code 1). Each fleet is
started, idle and cache-reset before its run. Reported per fleet: TTFT p50/p99, ITL (time between a
stream's token chunks) p50/p99, TPOT, goodput (share of requests within their class's TTFT SLO), errors;
for the split fleet the sidecar's own time before a response's first byte (its histogram, waits on workers
excluded), its step times and outcomes; then the hop alone (``sidecar_hop_ms``: one fast worker, direct
versus through the sidecar, median time to first byte). Targets (issue): ITL p99 ≤ 0.5× aggregated, TTFT p99 no worse,
goodput ≥ aggregated, sidecar ≤ 1 ms median. Writes DIR/report.json, DIR/report.md, DIR/disagg.png.
About 5 minutes with the defaults; note the host's load average beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench import host_quiet
from bench.loadgen import new_session
from bench.replay import Progress, Window, replay
from bench.report import parse_out_args
from bench.scenarios import SCENARIOS
from bench.sched_fleet import LAYOUTS, MODELS, BenchFleet, FleetLayout

DISAGGREGATED = FleetLayout("homogeneous-pd", (("chat-prefill", "h100-80gb", 1), ("chat", "h100-80gb", 2),
                                               ("code", "h100-80gb", 1)), prefill_pool="chat-prefill")
"""The peers benchmark's ``homogeneous`` fleet with one of its three chat H100s prefilling: the same GPUs."""
VARIANTS = (("aggregated", LAYOUTS["homogeneous"]), ("disaggregated", DISAGGREGATED))


async def sidecar_figures(session: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    buckets: dict[str, list[tuple[float, float]]] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                key = sample.name + "".join(f"/{v}" for k, v in sorted(sample.labels.items()) if k != "le")
                buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_total"):
                key = sample.name + "".join(f"/{v}" for v in sample.labels.values())
                counts[key] = sample.value
    return {"counts": counts,
            "overhead_p50_ms": bucket_quantile(buckets.get("poolgate_pd_overhead_seconds_bucket", []), 0.5) * 1000,
            "overhead_p99_ms": bucket_quantile(buckets.get("poolgate_pd_overhead_seconds_bucket", []), 0.99) * 1000,
            "prefill_p50_ms": bucket_quantile(buckets.get("poolgate_pd_step_seconds_bucket/prefill", []), 0.5) * 1000,
            "decode_first_byte_p50_ms": bucket_quantile(
                buckets.get("poolgate_pd_step_seconds_bucket/decode_first_byte", []), 0.5) * 1000}


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket holding the q-quantile (an upper estimate)."""
    ordered = sorted(buckets)
    total = ordered[-1][1] if ordered else 0.0
    if not total:
        return math.nan
    for bound, count in ordered:
        if count >= q * total:
            return bound
    return math.inf


async def sidecar_hop_ms(session: aiohttp.ClientSession, requests: int = 200) -> dict[str, float]:
    """What the sidecar adds to the time to first byte: one simulated worker (fast, one output token),
    requests alternately sent to it directly and through the sidecar (a decode-only pair: the sidecar's
    parse, encode and relay, the same per request as a split's decode step), 8k-token prompts."""
    from aiohttp import web

    from extproc.sidecar import PdSidecar
    from poolgate.kernel.routing import DECODE_HEADER
    from poolgate.procs import free_port
    from simworker.presets import PRESETS
    from simworker.worker import SimWorker, WorkerSpec

    worker_port, sidecar_port = free_port(), free_port()
    worker = SimWorker(WorkerSpec(port=worker_port, worker_id="hop", preset=PRESETS["h100-80gb"], time_scale=1000.0,
                                  max_model_len=16384, step_jitter=0.0))
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    runner = web.AppRunner(PdSidecar(30.0).build_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", sidecar_port).start()
    await worker.listening.wait()
    body = orjson.dumps({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "word " * 8000}],
                         "max_tokens": 1, "stream": True})
    timings: dict[str, list[float]] = {"direct": [], "sidecar": []}
    try:
        for index in range(requests):
            for route in ("direct", "sidecar") if index % 2 else ("sidecar", "direct"):
                url = f"http://127.0.0.1:{worker_port if route == 'direct' else sidecar_port}/v1/chat/completions"
                headers = {"content-type": "application/json",
                           **({DECODE_HEADER: f"127.0.0.1:{worker_port}"} if route == "sidecar" else {})}
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as response:
                    await response.content.readany()
                    timings[route].append(time.perf_counter() - started)
                    await response.read()
    finally:
        stop.set()
        await serving
        await runner.cleanup()
    direct, via = (sorted(timings[r])[len(timings[r]) // 2] * 1000 for r in ("direct", "sidecar"))
    return {"direct_p50_ms": direct, "sidecar_p50_ms": via, "added_p50_ms": via - direct}


async def run_variant(session: aiohttp.ClientSession, name: str, layout: FleetLayout, args: argparse.Namespace,
                      progress: Progress, report: dict[str, Any]) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"poolgate-bench-disagg-{name}-"))
    report["logs"].append(str(run_dir))
    fleet = BenchFleet(run_dir, args.time_scale, layout)
    scenario = SCENARIOS["mix"]
    window = Window(args.time_scale, args.window_s, args.drain_s)
    try:
        progress.show(f"starting the {name} fleet ({layout.describe()})")
        await fleet.start(session)
        await fleet.ensure_agent(8.0)
        trace = scenario.trace(args.rate, window.window_s * args.time_scale, args.seed, MODELS)
        await fleet.wait_idle(session)
        await fleet.reset_prefix_caches(session)
        row = await replay(session, fleet, fleet.target("poolgate"), 1.0, args.rate, trace.requests, trace.bodies,
                           window, [c.name for c in scenario.classes], progress, f"mix {name}")
        row.pop("ttft_samples_s", None)
        row["variant"], row["fleet"] = name, layout.describe()
        sidecar = fleet.stack.ports.pd_sidecar
        if sidecar is not None:
            row["sidecar"] = await sidecar_figures(session, sidecar)
        return row
    finally:
        await fleet.stop()


def targets(aggregated: dict[str, Any], split: dict[str, Any]) -> list[tuple[str, bool, str]]:
    sidecar = split.get("sidecar", {})
    return [
        ("ITL p99 ≤ 0.5× aggregated", split["itl_p99_s"] <= 0.5 * aggregated["itl_p99_s"],
         f"{split['itl_p99_s'] * 1000:.1f} ms vs {aggregated['itl_p99_s'] * 1000:.1f} ms"),
        ("TTFT p99 no worse", split["ttft_p99_s"] <= aggregated["ttft_p99_s"],
         f"{split['ttft_p99_s']:.2f} s vs {aggregated['ttft_p99_s']:.2f} s"),
        ("goodput ≥ aggregated", split["goodput_ratio"] >= aggregated["goodput_ratio"],
         f"{split['goodput_ratio']:.1%} vs {aggregated['goodput_ratio']:.1%}"),
        ("sidecar ≤ 1 ms median before the first byte", sidecar.get("overhead_p50_ms", math.inf) <= 1.0,
         f"own time {sidecar.get('overhead_p50_ms', math.nan):g} ms (bucket bound)"),
    ]


def hop_target(hop: dict[str, float]) -> tuple[str, bool, str]:
    return ("sidecar hop ≤ 1 ms median added to the first byte", hop["added_p50_ms"] <= 1.0,
            f"{hop['added_p50_ms']:.2f} ms ({hop['direct_p50_ms']:.2f} direct, {hop['sidecar_p50_ms']:.2f} via)")


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [f"# Prefill/decode disaggregation vs aggregated ({report['load']})", "",
             f"mix at {report['rate']} req/s (model), {report['window_model_s']:.0f} model s, "
             f"time scale {report['time_scale']}, seed {report['seed']}, split from "
             f"{report['min_prompt_tokens']} prompt tokens", "",
             host_quiet.describe(report.get("host")) + ".", "",
             "| variant | fleet | sent | errors | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p99 | goodput |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['variant']} | {row['fleet']} | {row['sent']} | {row['errors']} | "
                     f"{row['ttft_p50_s']:.2f} s | {row['ttft_p99_s']:.2f} s | {row['itl_p50_s'] * 1000:.1f} ms | "
                     f"{row['itl_p99_s'] * 1000:.1f} ms | {row['tpot_p99_s'] * 1000:.1f} ms | "
                     f"{row['goodput_ratio']:.1%} |")
    for row in rows:
        if "sidecar" in row:
            side = row["sidecar"]
            lines += ["", f"sidecar: own time before the first byte p50 ≤ {side['overhead_p50_ms']:g} ms, p99 ≤ "
                      f"{side['overhead_p99_ms']:g} ms; prefill step p50 ≤ {side['prefill_p50_ms']:g} ms, decode first "
                      f"byte p50 ≤ {side['decode_first_byte_p50_ms']:g} ms; counts {side['counts']}"]
    if len(rows) == 2:
        lines += ["", "| target | met | figures |", "|---|---|---|"]
        checks = targets(rows[0], rows[1]) + ([hop_target(report["hop"])] if "hop" in report else [])
        lines += [f"| {name} | {'yes' if met else 'MISSED'} | {figures} |" for name, met, figures in checks]
    return "\n".join(lines) + "\n"


def plot(out: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    names = [row["variant"] for row in rows]
    for axis, (key, label, scale) in zip(axes, (("ttft_p99_s", "TTFT p99 (s)", 1.0),
                                                ("itl_p99_s", "ITL p99 (ms)", 1000.0),
                                                ("goodput_ratio", "goodput", 1.0)), strict=True):
        axis.bar(names, [row[key] * scale for row in rows], color=["tab:gray", "tab:blue"][:len(rows)])
        axis.set_title(label)
    figure.tight_layout()
    figure.savefig(out / "disagg.png", dpi=100)
    plt.close(figure)


async def run(args: argparse.Namespace, out: Path, quiet: host_quiet.Sampler) -> dict[str, Any]:
    load = "load average " + " ".join(f"{v:.1f}" for v in os.getloadavg())
    report: dict[str, Any] = {"name": "disagg", "rate": args.rate, "min_prompt_tokens": args.min_prompt_tokens,
                              "time_scale": args.time_scale, "seed": args.seed,
                              "window_model_s": args.window_s * args.time_scale, "load": load, "rows": [],
                              "logs": [], "started": time.monotonic()}
    progress = Progress(len(VARIANTS))
    async with new_session() as session:
        try:
            for name, layout in VARIANTS:
                if name == "disaggregated":
                    layout = replace(layout, min_prompt_tokens=args.min_prompt_tokens)
                report["rows"].append(await run_variant(session, name, layout, args, progress, report))
            report["hop"] = await sidecar_hop_ms(session)
        finally:
            progress.close()
    report["wall_s"] = time.monotonic() - report.pop("started")
    report["load_after"] = "load average " + " ".join(f"{v:.1f}" for v in os.getloadavg())
    report = host_quiet.attach(report, quiet.summary())
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
                                                   default=str))
    (out / "report.md").write_text(markdown(report))
    plot(out, report["rows"])
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for report.json, report.md and disagg.png")
    parser.add_argument("--rate", type=float, default=2.0, help="mix requests per model second (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="simulated GPU speed versus real time (default %(default)s)")
    parser.add_argument("--window-s", type=float, default=80.0, help="arrival window, wall seconds")
    parser.add_argument("--drain-s", type=float, default=20.0, help="longest wait after the window, wall seconds")
    parser.add_argument("--min-prompt-tokens", type=int, default=2048,
                        help="disaggregation.min_prompt_tokens of the split fleet (default %(default)s: only the "
                             "summarisations are split)")
    parser.add_argument("--seed", type=int, default=21)


def main(argv: Sequence[str] | None = None) -> int:
    args, out = parse_out_args(__doc__, add_arguments, argv)
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(args, out, quiet))
    print(markdown(report))
    print(f"disaggregation benchmark took {report['wall_s'] / 60:.1f} min (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
