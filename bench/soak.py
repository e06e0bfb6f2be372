"""``poolgate bench soak --minutes M --out DIR``: steady load for a long time while workers keep dying.

The whole stack runs as users run it (``poolgate up``, simulated workers). A short closed-loop run first
measures what the fleet sustains on this machine; the soak then sends an open-loop mix at ``--load`` (70 %)
of that rate: non-streaming chat, streaming chat and non-streaming completions. Every ``--kill-every-s``
seconds one worker process is killed (SIGKILL, round robin); the controller restarts it.

Reported: success rate per request kind (target ≥ 99.9 % for non-streaming requests), p99 time to first
token per window (first SSE event for streams, the whole answer otherwise), and the resident memory of every
poolgate process (``up``, controller, extproc, Envoy, Redis, workers) after warm-up and at the end (target:
within ±10 %). A restarted worker is a new process, so workers are compared as a group.

``--chaos`` runs the chaos soak instead (``bench.chaos_soak``): the mixed workload on a stack with two
controllers, two extproc processes and Redis, all of which are killed in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import yaml

from bench import host_quiet
from bench.report import Column, Row, format_table
from bench.soak_measure import rss_mib

MODEL = "soak-model"
CONFIG = {
    "key_prefix": "soak",
    "controller": {"heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 1048576},
    "pools": [{"name": "chat", "model": MODEL, "max_model_len": 8192}],
    "workers": [{"id": f"w{i}", "pool": "chat"} for i in range(1, 4)],
}
KINDS = ("chat", "chat-stream", "completion")
TARGET_NON_STREAMING = 0.999
RSS_TOLERANCE = 0.10


@dataclass
class Result:
    kind: str
    sent_s: float
    ok: bool
    ttft_s: float | None
    status: int
    error: str = ""
    elapsed_s: float = 0.0


def _body(kind: str, rng: random.Random) -> tuple[str, bytes]:
    words = " ".join(["soak"] * rng.randint(10, 200))
    tokens = rng.randint(8, 48)
    if kind == "completion":
        return "/v1/completions", orjson.dumps({"model": MODEL, "prompt": words, "max_tokens": tokens})
    return "/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}],
                                                 "max_tokens": tokens, "stream": kind == "chat-stream"})


async def _one(session: aiohttp.ClientSession, base: str, kind: str, rng: random.Random, start: float) -> Result:
    path, body = _body(kind, rng)
    sent = time.monotonic()
    ttft: float | None = None
    try:
        async with session.post(base + path, data=body, headers={"content-type": "application/json"}) as response:
            if kind == "chat-stream" and response.status == 200:
                done = False
                async for chunk in response.content.iter_any():
                    if ttft is None and b"data: " in chunk:
                        ttft = time.monotonic() - sent
                    done = done or b"data: [DONE]" in chunk
                ok = done
            else:
                await response.read()
                ok = response.status == 200
                ttft = time.monotonic() - sent if ok else None
            return Result(kind, sent - start, ok, ttft, response.status, "" if ok else f"status {response.status}",
                          time.monotonic() - sent)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(kind, sent - start, False, ttft, 0, type(exc).__name__, time.monotonic() - sent)


async def _closed_loop(base: str, seconds: float, concurrency: int) -> float:
    """Requests per second the stack completes with ``concurrency`` clients (the capacity estimate)."""
    rng = random.Random(1)
    done = 0
    stop_at = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            result = await _one(session, base, rng.choice(KINDS), rng, 0.0)
            done += result.ok

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return done / seconds


async def _open_loop(base: str, rate: float, seconds: float, every: Callable[[float], None]) -> list[Result]:
    rng = random.Random(7)
    results: list[Result] = []
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()

    async def run(session: aiohttp.ClientSession, kind: str) -> None:
        results.append(await _one(session, base, kind, rng, start))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), connector=connector) as session:
        next_at = start
        while next_at - start < seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            task = asyncio.create_task(run(session, rng.choice(KINDS)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            every(time.monotonic() - start)
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=65)
    return results


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return sorted(found)


@dataclass
class Processes:
    up: int
    children: dict[str, int]
    """redis, controller, extproc, envoy → pid (``children.json`` of ``poolgate up``)."""

    def workers(self) -> list[int]:
        return children_of(self.children["controller"])

    def rss(self) -> dict[str, float | None]:
        memory = {"up": rss_mib(self.up), **{name: rss_mib(pid) for name, pid in self.children.items()}}
        workers = [rss_mib(pid) for pid in self.workers()]
        memory["workers (total)"] = sum(m for m in workers if m is not None) if workers else None
        return memory


@dataclass
class SoakReport:
    minutes: float
    capacity_rps: float
    rate_rps: float
    kills: int
    kinds: list[Row] = field(default_factory=list)
    windows: list[Row] = field(default_factory=list)
    memory: list[Row] = field(default_factory=list)
    non_streaming_success: float = 0.0
    passed: bool = False


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def summarise(results: list[Result], window_s: float) -> tuple[list[Row], list[Row]]:
    kinds: list[Row] = []
    for kind in KINDS:
        mine = [r for r in results if r.kind == kind]
        ok = sum(r.ok for r in mine)
        errors: dict[str, int] = {}
        for r in mine:
            if not r.ok:
                errors[r.error] = errors.get(r.error, 0) + 1
        kinds.append({"kind": kind, "sent": len(mine), "succeeded": ok, "failed": len(mine) - ok,
                      "success_pct": 100.0 * ok / len(mine) if mine else None,
                      "errors": ", ".join(f"{name} ×{count}" for name, count in sorted(errors.items())) or "-",
                      "slowest_failure_s": max((r.elapsed_s for r in mine if not r.ok), default=None)})
    windows: list[Row] = []
    last = max((r.sent_s for r in results), default=0.0)
    start = 0.0
    while start <= last:
        mine = [r for r in results if start <= r.sent_s < start + window_s]
        ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]
        p99 = _p99(ttfts)
        windows.append({"from_s": start, "requests": len(mine), "failed": sum(not r.ok for r in mine),
                        "p99_ttft_ms": p99 * 1000 if p99 is not None else None})
        start += window_s
    return kinds, windows


def start_stack(out: Path) -> tuple[subprocess.Popen[str], str, Path]:
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    from poolgate.procs import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "poolgate.cli", "up", "--config", str(config_path), "--port",
                                str(port), "--log-dir", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert process.stdout is not None
    deadline = time.monotonic() + 120
    for line in process.stdout:
        if line.startswith("READY "):
            return process, f"http://127.0.0.1:{port}", run_dir
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"poolgate up did not start; logs in {run_dir}")


def stop_stack(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if process.stdout:
        process.stdout.close()


def run(args: argparse.Namespace, quiet: host_quiet.Sampler) -> SoakReport:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    process, base, run_dir = start_stack(out)
    try:
        processes = Processes(process.pid, {k: int(v) for k, v in
                                            json.loads((run_dir / "children.json").read_text()).items()})
        capacity = asyncio.run(_closed_loop(base, args.calibrate_s, args.concurrency))
        rate = capacity * args.load
        print(f"soak: capacity {capacity:.1f} req/s, sending {rate:.1f} req/s for {args.minutes:g} min, a worker "
              f"killed every {args.kill_every_s:g} s", flush=True)
        memory_start = processes.rss()
        kills = 0
        next_kill = args.kill_every_s

        def maybe_kill(elapsed: float) -> None:
            nonlocal kills, next_kill
            if elapsed < next_kill:
                return
            next_kill += args.kill_every_s
            workers = processes.workers()
            if workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(workers[kills % len(workers)], signal.SIGKILL)
                kills += 1

        results = asyncio.run(_open_loop(base, rate, args.minutes * 60, maybe_kill))
        memory_end = processes.rss()
    finally:
        stop_stack(process)
    kinds, windows = summarise(results, args.window_s)
    memory: list[Row] = []
    rss_ok = True
    for name in memory_start:
        before, after = memory_start[name], memory_end.get(name)
        change = (after - before) / before * 100 if before and after else None
        if change is not None and name != "workers (total)" and abs(change) > RSS_TOLERANCE * 100:
            rss_ok = False
        memory.append({"process": name, "start_mib": before, "end_mib": after, "change_pct": change})
    non_streaming = [r for r in results if r.kind != "chat-stream"]
    success = sum(r.ok for r in non_streaming) / len(non_streaming) if non_streaming else 0.0
    report = SoakReport(args.minutes, capacity, rate, kills, kinds, windows, memory, success,
                        passed=success >= TARGET_NON_STREAMING and rss_ok)
    host = quiet.summary()
    (out / "soak.json").write_text(json.dumps(host_quiet.attach(asdict(report), host), indent=2))
    tables = [
        format_table(kinds, [Column("kind", "kind", "{}"), Column("sent", "sent", "{}"),
                             Column("succeeded", "ok", "{}"), Column("failed", "failed", "{}"),
                             Column("success_pct", "success %", "{:.3f}"), Column("errors", "errors", "{}"),
                             Column("slowest_failure_s", "slowest failure s", "{:.2f}")]),
        format_table(windows, [Column("from_s", "from s", "{:.0f}"), Column("requests", "requests", "{}"),
                               Column("failed", "failed", "{}"), Column("p99_ttft_ms", "p99 TTFT ms", "{:.0f}")]),
        format_table(memory, [Column("process", "process", "{}"), Column("start_mib", "RSS start MiB", "{:.1f}"),
                              Column("end_mib", "RSS end MiB", "{:.1f}"), Column("change_pct", "change %", "{:+.1f}")]),
    ]
    summary = (f"soak {args.minutes:g} min at {rate:.1f} req/s ({args.load:.0%} of {capacity:.1f}), {kills} worker "
               f"kills: non-streaming success {success:.4%} (target {TARGET_NON_STREAMING:.1%}), RSS within "
               f"±{RSS_TOLERANCE:.0%}: {'yes' if rss_ok else 'no'} → {'PASS' if report.passed else 'FAIL'}\n"
               + host_quiet.describe(host.as_dict()))
    text = "\n\n".join([*tables, summary])
    (out / "soak.md").write_text(f"# Soak\n\n```\n{text}\n```\n")
    print(text)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poolgate bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chaos", action="store_true",
                        help="the chaos soak (bench/chaos_soak.py): mixed workload on a two-controller stack "
                             "while workers, extproc, the leading controller and the Redis master are killed in turn")
    parser.add_argument("--short", action="store_true",
                        help="--chaos: a check of a few minutes (3 minutes unless --minutes, a fault every 20 s, "
                             "short capacity steps); its figures are no soak's")
    parser.add_argument("--minutes", type=float, default=None, help="default 10 (--chaos: 30)")
    parser.add_argument("--out", default=None, help="report directory (default: a new temporary directory)")
    parser.add_argument("--load", type=float, default=0.7, help="share of the measured capacity (default 0.7)")
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=30.0, help="p99 TTFT window")
    parser.add_argument("--calibrate-s", type=float, default=None,
                        help="capacity run (--chaos: each step's counted window); default 15 (--chaos: 30)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the capacity run")
    parser.add_argument("--fault-every-s", type=float, default=60.0, help="--chaos: one fault this often")
    parser.add_argument("--calibrate-warmup-s", type=float, default=10.0, help="--chaos: warm-up of each step")
    parser.add_argument("--sample-s", type=float, default=20.0, help="--chaos: RSS sampling interval")
    args = parser.parse_args(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="poolgate-soak-")
    args.minutes = args.minutes if args.minutes is not None else (
        3.0 if args.chaos and args.short else 30.0 if args.chaos else 10.0)
    args.calibrate_s = args.calibrate_s if args.calibrate_s is not None else (30.0 if args.chaos else 15.0)
    if args.chaos:
        from bench.chaos_soak import run as run_chaos

        if args.short:
            args.fault_every_s, args.calibrate_s, args.calibrate_warmup_s, args.sample_s = 20.0, 8.0, 3.0, 10.0

        return run_chaos(args)
    with host_quiet.measure() as quiet:
        report = run(args, quiet)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
