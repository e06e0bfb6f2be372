"""What extproc costs: Envoy alone vs Envoy + extproc in front of the same upstream, side by side.

Two Envoys run at once from the same rendered bootstrap; one has the ext_proc filter removed (it serves
through the default route), the other asks extproc, which parses the body and pins the worker. The
upstream answers a fixed completion at once, so the difference is the extproc hop. Runs alternate
(A, B, A, B, …) and the report quotes medians over rounds, so machine noise hits both sides alike.

Load comes from ``wrk`` (Debian package ``wrk``), which measures each request's latency; extproc's own CPU
time over the run (from /proc) gives requests per extproc CPU-second, i.e. what one process sustains
on one core.

    .venv/bin/python bench/extproc_overhead.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import ProcessGroup, cpu_seconds
from bench.report import write_report
from poolgate.envoy_bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.procs import envoy_binary, free_port, wait_port

MODEL = "bench-model"
BODY = ('{"model": "bench-model", "messages": [{"role": "user", "content": "Hello there, how are you today?"}], '
        '"max_tokens": 8}')
TOKEN = "bench-token"

WRK_SCRIPT = f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{BODY}'
"""


def parse_wrk(output: str) -> dict[str, float]:
    """Requests/sec and the 50/99th latency percentiles (ms) from ``wrk --latency`` output."""
    units = {"us": 0.001, "ms": 1.0, "s": 1000.0}
    result: dict[str, float] = {}
    for pct in ("50", "99"):
        match = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", output, re.MULTILINE)
        if match:
            result[f"p{pct}_ms"] = float(match.group(1)) * units[match.group(2)]
    match = re.search(r"Requests/sec:\s+([\d.]+)", output)
    result["rps"] = float(match.group(1)) if match else 0.0
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    result["non_2xx"] = float(non2xx.group(1)) if non2xx else 0.0
    total = re.search(r"(\d+) requests in", output)
    result["requests"] = float(total.group(1)) if total else 0.0
    return result


def run_wrk(url: str, concurrency: int, seconds: float, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout
    return parse_wrk(out)


async def register_upstream(api: str, port: int, stop: asyncio.Event) -> None:
    """Register the upstream as a worker through the controller's API and keep it alive."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{api}/v1/workers", json={"id": "upstream-1", "pool": "bench",
                                                        "host": "127.0.0.1", "port": port}) as response:
            response.raise_for_status()
        while not stop.is_set():
            async with http.post(f"{api}/v1/workers/upstream-1/heartbeat", json={}) as response:
                await response.read()
            await asyncio.sleep(0.25)


def without_ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The same bootstrap with the ext_proc filter removed: plain Envoy in front of the same fleet."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
    return bootstrap


async def wait_serving(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                    if r.status == 200 and r.headers.get("x-poolgate-worker"):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never served")


async def bench(seconds: float, rounds: int, concurrencies: list[int]) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("redis-server is needed: apt-get install redis-server")
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-bench-"))
    ports = {name: free_port() for name in ("redis", "upstream", "xds", "api", "extproc", "envoy_a", "admin_a",
                                            "envoy_b", "admin_b")}
    config = parse_config({"pools": [{"name": "bench", "model": MODEL}],
                           "controller": {"token": TOKEN}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    python = [sys.executable, "-m", "poolgate.cli"]
    group = ProcessGroup(run_dir)
    stop_heartbeats = asyncio.Event()
    try:
        group.start("redis", [redis_server, "--port", str(ports["redis"]), "--save", "", "--appendonly", "no"])
        await wait_port("127.0.0.1", ports["redis"], 10)
        group.start("upstream", [sys.executable, str(Path(__file__).parent / "harness.py"), "upstream",
                                 str(ports["upstream"])])
        group.start("controller", [*python, "controller", "--config", str(run_dir / "config.yaml"), "--redis-url",
                                   redis_url, "--xds-port", str(ports["xds"]), "--http-port", str(ports["api"]),
                                   "--no-workers"])
        extproc = group.start("extproc", [*python, "extproc", "--config", str(run_dir / "config.yaml"),
                                          "--redis-url", redis_url, "--port", str(ports["extproc"])])
        for port in ("upstream", "api", "xds", "extproc"):
            if not await wait_port("127.0.0.1", ports[port], 30):
                raise RuntimeError(f"{port} did not start; logs in {run_dir}")
        heartbeats = asyncio.create_task(register_upstream(f"http://127.0.0.1:{ports['api']}", ports["upstream"],
                                                           stop_heartbeats))
        urls = {}
        for side, strip in (("with_extproc", False), ("envoy_alone", True)):
            suffix = "a" if side == "with_extproc" else "b"
            bootstrap = render_bootstrap(config, node_id=f"bench-{suffix}", listen_port=ports[f"envoy_{suffix}"],
                                         admin_port=ports[f"admin_{suffix}"], extproc_port=ports["extproc"],
                                         xds_port=ports["xds"])
            if strip:
                bootstrap = without_ext_proc(bootstrap)
            path = run_dir / f"envoy-{suffix}.yaml"
            path.write_text(yaml.safe_dump(bootstrap))
            group.start(f"envoy-{suffix}", [str(envoy_binary()), "-c", str(path), "-l", "error",
                                            "--use-dynamic-base-id", "--disable-hot-restart", "--concurrency", "1"])
            urls[side] = f"http://127.0.0.1:{ports[f'envoy_{suffix}']}/v1/chat/completions"
        for url in urls.values():
            await wait_serving(url)
        script = run_dir / "post.lua"
        script.write_text(WRK_SCRIPT)
        samples: dict[str, dict[int, list[dict[str, float]]]] = {s: {c: [] for c in concurrencies} for s in urls}
        for concurrency in concurrencies:
            run_wrk(urls["with_extproc"], concurrency, 1, script)  # warm-up
            run_wrk(urls["envoy_alone"], concurrency, 1, script)
            for _ in range(rounds):
                for side, url in urls.items():
                    cpu_before = cpu_seconds(extproc.pid)
                    result = await asyncio.to_thread(run_wrk, url, concurrency, seconds, script)
                    result["extproc_cpu_s"] = cpu_seconds(extproc.pid) - cpu_before
                    samples[side][concurrency].append(result)
        stop_heartbeats.set()
        heartbeats.cancel()
    finally:
        group.stop_all()
    return summarise(samples, seconds, rounds)


def summarise(samples: dict[str, dict[int, list[dict[str, float]]]], seconds: float, rounds: int) -> dict[str, Any]:
    rows = []
    for concurrency in samples["with_extproc"]:
        alone = samples["envoy_alone"][concurrency]
        routed = samples["with_extproc"][concurrency]

        def med(runs: list[dict[str, float]], key: str) -> float:
            return statistics.median(r.get(key, 0.0) for r in runs)

        requests = sum(r["requests"] for r in routed)
        cpu = sum(r["extproc_cpu_s"] for r in routed)
        rows.append({
            "concurrency": concurrency,
            "alone_p50_ms": med(alone, "p50_ms"), "alone_p99_ms": med(alone, "p99_ms"),
            "alone_rps": med(alone, "rps"),
            "extproc_p50_ms": med(routed, "p50_ms"), "extproc_p99_ms": med(routed, "p99_ms"),
            "extproc_rps": med(routed, "rps"),
            "added_p50_ms": med(routed, "p50_ms") - med(alone, "p50_ms"),
            "added_p99_ms": med(routed, "p99_ms") - med(alone, "p99_ms"),
            "extproc_cpu_us_per_request": 1e6 * cpu / requests if requests else 0.0,
            "requests_per_extproc_cpu_second": requests / cpu if cpu else 0.0,
            "errors": sum(r["non_2xx"] for r in alone + routed),
        })
    return {"seconds_per_run": seconds, "rounds": rounds, "cores": os.cpu_count(), "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    header = (f"{'c':>3} {'alone p50':>10} {'+ext p50':>9} {'added p50':>10} {'alone p99':>10} {'+ext p99':>9} "
              f"{'added p99':>10} {'alone rps':>10} {'+ext rps':>9} {'ext µs/req':>11} {'req/ext-cpu-s':>14}")
    print(header)
    for row in report["rows"]:
        print(f"{row['concurrency']:>3} {row['alone_p50_ms']:>9.2f}m {row['extproc_p50_ms']:>8.2f}m "
              f"{row['added_p50_ms']:>9.2f}m {row['alone_p99_ms']:>9.2f}m {row['extproc_p99_ms']:>8.2f}m "
              f"{row['added_p99_ms']:>9.2f}m {row['alone_rps']:>10.0f} {row['extproc_rps']:>9.0f} "
              f"{row['extproc_cpu_us_per_request']:>11.0f} {row['requests_per_extproc_cpu_second']:>14.0f}")


def plot(report: dict[str, Any], axes: Any) -> None:
    rows = report["rows"]
    labels = [f"c={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    width = 0.2
    axes.bar([x - 1.5 * width for x in xs], [r["alone_p50_ms"] for r in rows], width, label="Envoy alone p50")
    axes.bar([x - 0.5 * width for x in xs], [r["extproc_p50_ms"] for r in rows], width, label="+ extproc p50")
    axes.bar([x + 0.5 * width for x in xs], [r["alone_p99_ms"] for r in rows], width, label="Envoy alone p99")
    axes.bar([x + 1.5 * width for x in xs], [r["extproc_p99_ms"] for r in rows], width, label="+ extproc p99")
    axes.set_xticks(list(xs), labels)
    axes.set_ylabel("latency (ms)")
    axes.set_title("Envoy alone vs Envoy + extproc, same upstream")
    axes.legend()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per side and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args(argv)
    report = asyncio.run(bench(args.seconds, args.rounds, args.concurrency))
    print_table(report)
    write_report("extproc_overhead", report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
