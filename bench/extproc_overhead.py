"""What extproc costs: Envoy alone vs Envoy + extproc (1 and N processes) in front of the same upstream.

Envoys run at once from the same rendered bootstrap: ``alone`` has the ext_proc filter removed (it serves
through the default route), ``one`` asks a single extproc process, ``many`` asks N processes (one endpoint
each of the ext_proc cluster), ``observed`` asks one process that reads the response (GenAI metrics on),
``observer`` asks one process that does not read it plus a second ext_proc filter in ``observability_mode``
whose server (``harness.py observer``) runs the same per-chunk observers and answers nothing.
The upstream answers a fixed completion at once (or 64 paced SSE chunks), so the difference is the extproc
hop. Runs alternate (alone, one, many, …) and the report quotes medians over rounds, so machine noise hits
every side alike. One run reports, side by side:

- latency and req/s at each concurrency (default 1, 16, 64, 256) for alone / one / many;
- the body-size sweep (4 KB, 64 KB, 256 KB, 1 MB prompts) at one client, alone vs one;
- streamed responses: extproc CPU per SSE chunk while it observes them (answering each chunk, today's way,
  against the observability-mode filter), and the stream's latency;
- routed requests per extproc CPU-second (all processes' CPU from /proc).

Load comes from ``wrk`` (Debian package ``wrk``).

    .venv/bin/python bench/extproc_overhead.py [--seconds 3] [--rounds 2] [--processes N]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
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
import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import host_quiet
from bench.harness import STREAM_CHUNKS, ProcessGroup, cpu_seconds
from bench.report import write_report
from controller.xds.bootstrap import EXTPROC_CLUSTER, render_bootstrap
from poolgate.kernel.config import Config, parse_config
from poolgate.procs import envoy_binary, free_port, wait_port

MODEL = "bench-model"
TOKEN = "bench-token"
BODY_SIZES = (4 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)
LOAD_SIDES = ("alone", "one", "many")


def chat_body(content_chars: int = 32, stream: bool = False) -> bytes:
    """A chat request whose one message has ``content_chars`` characters (``"stream": true`` first, which the
    upstream looks for)."""
    words = ("lorem ipsum dolor sit amet " * (content_chars // 27 + 1))[:content_chars]
    return orjson.dumps({"stream": stream, "model": MODEL, "messages": [{"role": "user", "content": words}],
                         "max_tokens": 8})


def wrk_script(body_path: Path) -> str:
    return (f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f'local f = io.open("{body_path}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')


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
        # wrk's default 2 s timeout would drop slow answers (a 65-chunk stream on a loaded box) from the figures
        ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "30s", "--latency", "-s",
         str(script), url],
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


OBSERVER_CLUSTER = "poolgate-observer"


def with_observer(bootstrap: dict[str, Any], port: int) -> dict[str, Any]:
    """The bootstrap with a second ext_proc filter before the router: ``observability_mode``, response headers
    and body (STREAMED) only, to the observer server's cluster."""
    clusters = bootstrap["static_resources"]["clusters"]
    extproc_cluster = next(c for c in clusters if c["name"] == EXTPROC_CLUSTER)
    observer_cluster = copy.deepcopy(extproc_cluster)
    observer_cluster.update(name=OBSERVER_CLUSTER, lb_policy="ROUND_ROBIN")
    observer_cluster.pop("health_checks", None)
    observer_cluster["load_assignment"] = {"cluster_name": OBSERVER_CLUSTER, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}
    clusters.append(observer_cluster)
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                filters = network_filter["typed_config"]["http_filters"]
                routing = next(f for f in filters if "ext_proc" in f["name"])
                observing = copy.deepcopy(routing)
                observing["name"] = "poolgate-observer"
                config = observing["typed_config"]
                config["grpc_service"]["envoy_grpc"]["cluster_name"] = OBSERVER_CLUSTER
                config["observability_mode"] = True
                config["response_attributes"] = ["request.id"]
                config["processing_mode"] = {"request_header_mode": "SKIP", "response_header_mode": "SEND",
                                             "request_body_mode": "NONE", "response_body_mode": "STREAMED",
                                             "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
                for key in ("allow_mode_override", "metadata_options", "max_message_timeout", "mutation_rules"):
                    config.pop(key, None)
                filters.insert(filters.index(routing) + 1, observing)
    return bootstrap


async def wait_serving(url: str, routed: bool, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.post(url, data=chat_body(), headers={"content-type": "application/json"}) as r:
                    if r.status == 200 and (not routed or r.headers.get("x-poolgate-worker")):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never served")


class Bench:
    """The processes of one run and the measurements taken against them."""

    def __init__(self, run_dir: Path, processes: int, seconds: float, rounds: int) -> None:
        self.run_dir = run_dir
        self.group = ProcessGroup(run_dir)
        self.processes = processes
        self.seconds = seconds
        self.rounds = rounds
        self.urls: dict[str, str] = {}
        self.extproc_pids: dict[str, list[int]] = {}
        """Side → the pids of the extproc processes it asks (none for ``alone``)."""
        self.observer_pid = 0
        self.ports = {name: free_port() for name in ("redis", "upstream", "xds", "api")}
        self.redis_url = f"redis://127.0.0.1:{self.ports['redis']}/0"

    def config(self, observed: bool) -> Config:
        return parse_config({"pools": [{"name": "bench", "model": MODEL}], "controller": {"token": TOKEN},
                             "observability": {"genai_metrics": observed}})

    async def start_fleet(self) -> None:
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            raise SystemExit("redis-server is needed: apt-get install redis-server")
        ports, python = self.ports, [sys.executable, "-m", "poolgate.cli"]
        self.group.start("redis", [redis_server, "--port", str(ports["redis"]), "--save", "", "--appendonly", "no"])
        await wait_port("127.0.0.1", ports["redis"], 10)
        config_path = self.write_config("plain", self.config(observed=False))
        self.group.start("upstream", [sys.executable, str(Path(__file__).parent / "harness.py"), "upstream",
                                      str(ports["upstream"])])
        self.group.start("controller", [*python, "controller", "--config", str(config_path), "--redis-url",
                                        self.redis_url, "--xds-port", str(ports["xds"]), "--http-port",
                                        str(ports["api"]), "--no-workers"])
        for port in ("upstream", "api", "xds"):
            if not await wait_port("127.0.0.1", ports[port], 30):
                raise RuntimeError(f"{port} did not start; logs in {self.run_dir}")

    def write_config(self, name: str, config: Config) -> Path:
        path = self.run_dir / f"config-{name}.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        return path

    def start_observer(self) -> tuple[int, int]:
        """The observability-mode server: its port and pid."""
        port = free_port()
        child = self.group.start("observer", [sys.executable, str(Path(__file__).parent / "harness.py"), "observer",
                                              str(port)])
        return port, child.pid

    async def start_side(self, side: str, processes: int, observed: bool = False, observer: bool = False) -> None:
        """An Envoy asking ``processes`` extproc processes (none: Envoy alone); ``observer``: and a second
        ext_proc filter in observability mode."""
        config = self.config(observed)
        config_path = self.write_config(side, config)
        extproc_ports = [free_port() for _ in range(processes)]
        pids = []
        for index, port in enumerate(extproc_ports):
            child = self.group.start(f"extproc-{side}-{index}", [
                sys.executable, "-m", "poolgate.cli", "extproc", "--config", str(config_path), "--redis-url",
                self.redis_url, "--port", str(port)])
            pids.append(child.pid)
        for port in extproc_ports:
            if not await wait_port("127.0.0.1", port, 30):
                raise RuntimeError(f"extproc of {side} did not start; logs in {self.run_dir}")
        listen, admin = free_port(), free_port()
        bootstrap = render_bootstrap(config, node_id=f"bench-{side}", listen_port=listen, admin_port=admin,
                                     extproc_port=extproc_ports or [free_port()], xds_port=self.ports["xds"])
        if not processes:
            bootstrap = without_ext_proc(bootstrap)
        if observer:
            observer_port, observer_pid = self.start_observer()
            if not await wait_port("127.0.0.1", observer_port, 30):
                raise RuntimeError(f"the observer did not start; logs in {self.run_dir}")
            bootstrap = with_observer(bootstrap, observer_port)
            self.observer_pid = observer_pid
        path = self.run_dir / f"envoy-{side}.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        self.group.start(f"envoy-{side}", [str(envoy_binary()), "-c", str(path), "-l", "error",
                                           "--use-dynamic-base-id", "--disable-hot-restart", "--concurrency", "1"])
        self.urls[side] = f"http://127.0.0.1:{listen}/v1/chat/completions"
        self.extproc_pids[side] = pids
        await wait_serving(self.urls[side], routed=processes > 0)

    def script(self, name: str, body: bytes) -> Path:
        body_path = self.run_dir / f"body-{name}.json"
        body_path.write_bytes(body)
        path = self.run_dir / f"wrk-{name}.lua"
        path.write_text(wrk_script(body_path))
        return path

    def extproc_cpu(self, side: str) -> float:
        return sum(cpu_seconds(pid) for pid in self.extproc_pids[side])

    async def measure(self, sides: tuple[str, ...], concurrency: int, script: Path) -> (
            dict[str, list[dict[str, float]]]):
        """``rounds`` alternating wrk runs per side after a one-second warm-up each."""
        for side in sides:
            await asyncio.to_thread(run_wrk, self.urls[side], concurrency, 1, script)
        samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(self.rounds):
            for side in sides:
                before = self.extproc_cpu(side)
                observer_before = cpu_seconds(self.observer_pid) if side == "observer" else 0.0
                result = await asyncio.to_thread(run_wrk, self.urls[side], concurrency, self.seconds, script)
                result["extproc_cpu_s"] = self.extproc_cpu(side) - before
                if side == "observer":
                    result["observer_cpu_s"] = cpu_seconds(self.observer_pid) - observer_before
                samples[side].append(result)
        return samples


def med(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in runs)


def side_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    requests = sum(r["requests"] for r in runs)
    cpu = sum(r.get("extproc_cpu_s", 0.0) for r in runs)
    return {"p50_ms": med(runs, "p50_ms"), "p99_ms": med(runs, "p99_ms"), "rps": med(runs, "rps"),
            "cpu_us_per_request": 1e6 * cpu / requests if requests and cpu else 0.0,
            "requests_per_cpu_s": requests / cpu if cpu else 0.0,
            "errors": sum(r["non_2xx"] for r in runs)}


def load_row(concurrency: int, samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": concurrency}
    for side, runs in samples.items():
        row.update({f"{side}_{key}": value for key, value in side_figures(runs).items()})
    for side in samples:
        if side != "alone":
            row[f"{side}_added_p50_ms"] = row[f"{side}_p50_ms"] - row["alone_p50_ms"]
            row[f"{side}_added_p99_ms"] = row[f"{side}_p99_ms"] - row["alone_p99_ms"]
    return row


async def stream_row(bench: Bench, concurrency: int = 16) -> dict[str, Any]:
    """Streamed responses through ``alone``, ``observed`` (extproc answers every chunk) and ``observer`` (an
    observability-mode filter sees them): extproc CPU per chunk is the observing process's CPU per streamed
    request less its CPU per plain request (``observed``), or the observer server's CPU per streamed
    request (``observer``: nothing else reaches it), over the chunks of one stream."""
    plain = await bench.measure(("observed",), concurrency, bench.script("plain", chat_body()))
    streamed = await bench.measure(("alone", "observed", "observer"), concurrency,
                                   bench.script("stream", chat_body(stream=True)))
    per_plain = side_figures(plain["observed"])["cpu_us_per_request"]
    observed = side_figures(streamed["observed"])
    chunks = STREAM_CHUNKS + 1  # the [DONE] event
    alone_p50 = med(streamed["alone"], "p50_ms")
    observer_runs = streamed["observer"]
    observer_requests = sum(r["requests"] for r in observer_runs)
    observer_cpu = sum(r.get("observer_cpu_s", 0.0) for r in observer_runs)
    observer_us = 1e6 * observer_cpu / observer_requests if observer_requests else 0.0
    return {"concurrency": concurrency, "chunks_per_stream": chunks,
            "alone_stream_p50_ms": alone_p50,
            "observed_stream_p50_ms": observed["p50_ms"],
            "added_stream_p50_ms": observed["p50_ms"] - alone_p50,
            "cpu_us_per_stream": observed["cpu_us_per_request"],
            "cpu_us_per_chunk": (observed["cpu_us_per_request"] - per_plain) / chunks,
            "chunks_per_cpu_s": 1e6 * chunks / observed["cpu_us_per_request"] if observed["cpu_us_per_request"] else 0,
            "observer_stream_p50_ms": med(observer_runs, "p50_ms"),
            "observer_added_stream_p50_ms": med(observer_runs, "p50_ms") - alone_p50,
            "observer_cpu_us_per_chunk": observer_us / chunks,
            "observer_routing_cpu_us_per_stream": side_figures(observer_runs)["cpu_us_per_request"],
            "errors": observed["errors"] + sum(r["non_2xx"] for r in observer_runs)}


async def bench_all(seconds: float, rounds: int, concurrencies: list[int], processes: int,
                    body_sizes: list[int]) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    bench = Bench(Path(tempfile.mkdtemp(prefix="poolgate-bench-")), processes, seconds, rounds)
    stop_heartbeats = asyncio.Event()
    try:
        await bench.start_fleet()
        heartbeats = asyncio.create_task(register_upstream(f"http://127.0.0.1:{bench.ports['api']}",
                                                           bench.ports["upstream"], stop_heartbeats))
        for side, count in (("alone", 0), ("one", 1), ("many", processes)):
            await bench.start_side(side, count)
        await bench.start_side("observed", 1, observed=True)
        await bench.start_side("observer", 1, observer=True)
        small = bench.script("small", chat_body())
        rows = [load_row(c, await bench.measure(LOAD_SIDES, c, small)) for c in concurrencies]
        body_rows = []
        for size in body_sizes:
            row = load_row(1, await bench.measure(("alone", "one"), 1, bench.script(f"b{size}", chat_body(size))))
            body_rows.append({"body_bytes": size, **row})
        stream = await stream_row(bench)
        stop_heartbeats.set()
        heartbeats.cancel()
    finally:
        bench.group.stop_all()
    return {"seconds_per_run": seconds, "rounds": rounds, "cores": os.cpu_count(), "processes": processes,
            "rows": rows, "body_rows": body_rows, "stream": stream}


def print_report(report: dict[str, Any]) -> None:
    n = report["processes"]
    print(f"latency (ms) and throughput; 'one' = 1 extproc process, 'many' = {n}")
    print(f"{'c':>4} {'alone p50':>9} {'one +p50':>9} {'many +p50':>9} {'alone p99':>9} {'one +p99':>9} "
          f"{'many +p99':>9} {'alone rps':>9} {'one rps':>8} {'many rps':>8} {'one r/cpu-s':>11} {'many r/cpu-s':>12}")
    for r in report["rows"]:
        print(f"{r['concurrency']:>4} {r['alone_p50_ms']:>9.2f} {r['one_added_p50_ms']:>9.2f} "
              f"{r['many_added_p50_ms']:>9.2f} {r['alone_p99_ms']:>9.2f} {r['one_added_p99_ms']:>9.2f} "
              f"{r['many_added_p99_ms']:>9.2f} {r['alone_rps']:>9.0f} {r['one_rps']:>8.0f} {r['many_rps']:>8.0f} "
              f"{r['one_requests_per_cpu_s']:>11.0f} {r['many_requests_per_cpu_s']:>12.0f}")
    print("\nbody size at one client (alone vs one process)")
    print(f"{'bytes':>8} {'alone p50':>9} {'+ext p50':>9} {'added p50':>9} {'ext µs/req':>10}")
    for r in report["body_rows"]:
        print(f"{r['body_bytes']:>8} {r['alone_p50_ms']:>9.2f} {r['one_p50_ms']:>9.2f} {r['one_added_p50_ms']:>9.2f} "
              f"{r['one_cpu_us_per_request']:>10.0f}")
    s = report["stream"]
    print(f"\nstreamed responses, c={s['concurrency']}, {s['chunks_per_stream']} chunks: alone p50 "
          f"{s['alone_stream_p50_ms']:.1f} ms, observed p50 {s['observed_stream_p50_ms']:.1f} ms "
          f"(added {s['added_stream_p50_ms']:+.2f}); extproc {s['cpu_us_per_chunk']:.1f} µs CPU per chunk "
          f"beyond the request, {s['chunks_per_cpu_s']:.0f} chunks per extproc CPU-second overall")
    print(f"observability-mode filter instead: stream p50 {s['observer_stream_p50_ms']:.1f} ms (added "
          f"{s['observer_added_stream_p50_ms']:+.2f}); observer {s['observer_cpu_us_per_chunk']:.1f} µs CPU per "
          f"chunk; routing extproc {s['observer_routing_cpu_us_per_stream']:.0f} µs per streamed request")


def plot(report: dict[str, Any], axes: list[Any]) -> None:
    rows, n = report["rows"], report["processes"]
    xs = [str(r["concurrency"]) for r in rows]
    for side, label in (("alone", "Envoy alone"), ("one", "+ 1 extproc"), ("many", f"+ {n} extprocs")):
        axes[0].plot(xs, [r[f"{side}_p50_ms"] for r in rows], marker="o", label=f"{label} p50")
        axes[1].plot(xs, [r[f"{side}_rps"] for r in rows], marker="o", label=label)
    axes[0].set(xlabel="clients", ylabel="latency (ms)", yscale="log", title="median latency")
    axes[1].set(xlabel="clients", ylabel="requests/s", title="throughput")
    body = report["body_rows"]
    kb = [f"{r['body_bytes'] // 1024}K" for r in body]
    axes[2].plot(kb, [r["alone_p50_ms"] for r in body], marker="o", label="Envoy alone")
    axes[2].plot(kb, [r["one_p50_ms"] for r in body], marker="o", label="+ extproc")
    axes[2].set(xlabel="body", ylabel="p50 latency (ms)", title="body size, one client")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one wrk run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side and setting")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 2, help="N of the 'many' side")
    parser.add_argument("--body-bytes", type=int, nargs="+", default=list(BODY_SIZES))
    args = parser.parse_args(argv)
    with host_quiet.measure() as quiet:
        report = asyncio.run(bench_all(args.seconds, args.rounds, args.concurrency, args.processes, args.body_bytes))
    print_report(report)
    write_report("extproc_overhead", report, plot, panels=3, host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
