"""How one simulated worker behaves as load rises, and how much load one simulator process can model.

Sweep (default): Poisson arrivals at each request rate against one worker over HTTP, mixed prompt
sizes (60 % 64-512 tokens, 30 % 512-2048, 10 % 2048-4096) and 64-256 output tokens (``ignore_eos``).
Per rate: output tokens/s received during the arrival window (it includes the ramp-up, so it reads a
little under the offered load when not saturated), TTFT p50/p99 as the client sees it, mean/max KV
usage from ``/metrics``, preemptions. The default worker is the 24 GB preset, whose small KV cache
and slow steps show the saturation knee at a few requests per second, run ``--time-scale`` times
faster than real time. All figures are in model time (real seconds x time scale), so they read as
on the modelled GPU. Requests still unanswered after the drain limit are cut and counted; their
wait so far enters the TTFT percentiles as a lower bound.

Drift (``--drift``): N workers in one simulator process, M closed-loop streams each, on the 80 GB
preset (short steps, the heaviest load for the host). Reports the driver's step lag (how late steps
end versus the model) from ``poolgate_sim_step_lag_seconds``: when the lag becomes a noticeable share
of the modelled step time, the process no longer keeps up with its own model. The load generator
runs on the same host and competes for its CPUs.

Run: ``python bench/sim_sweep.py [--quick] [--drift]``; reports go to ``bench/reports``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from bench import host_quiet
from bench.harness import lag_quantile, scrape
from bench.measure import percentile
from bench.report import Column, Panel, save_rows
from poolgate.procs import free_port, simworker_process

SAMPLE_INTERVAL_S = 0.25


# ---------------------------------------------------------------- sweep


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class JobResult:
    ttft_s: float | None = None
    tokens: int = 0
    tokens_in_window: int = 0
    finished: bool = False


def prompt_length(rng: random.Random) -> int:
    draw = rng.random()
    if draw < 0.6:
        return rng.randint(64, 512)
    if draw < 0.9:
        return rng.randint(512, 2048)
    return rng.randint(2048, 4096)


def make_jobs(rate: float, window_s: float, rng: random.Random) -> list[Job]:
    jobs, arrival = [], rng.expovariate(rate)
    while arrival < window_s:
        prompt = [rng.randrange(1, 50_000) for _ in range(prompt_length(rng))]
        jobs.append(Job(arrival, prompt, rng.randint(64, 256)))
        arrival += rng.expovariate(rate)
    return jobs


async def run_job(session: aiohttp.ClientSession, url: str, job: Job, started: float, scale: float,
                  window_end: float, result: JobResult) -> None:
    await asyncio.sleep(max(0.0, started + job.arrival_s / scale - time.monotonic()))
    sent = time.monotonic()
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if result.ttft_s is None:
                result.ttft_s = time.monotonic() - sent
            result.tokens += 1
            if time.monotonic() <= window_end:
                result.tokens_in_window += 1
    result.finished = True


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = await scrape(session, url)
        if samples["vllm:num_requests_running"] + samples["vllm:num_requests_waiting"] == 0:
            return
        await asyncio.sleep(0.1)


async def run_rate(session: aiohttp.ClientSession, url: str, rate: float, window_s: float, drain_s: float,
                   scale: float, rng: random.Random) -> dict[str, float | int]:
    """One rate, in model time: ``rate`` requests per model second for ``window_s`` model seconds."""
    jobs = make_jobs(rate, window_s, rng)
    results = [JobResult() for _ in jobs]
    before = await scrape(session, url)
    kv_samples: list[float] = []
    started = time.monotonic()

    async def sample_kv() -> None:
        while True:
            kv_samples.append((await scrape(session, url))["vllm:kv_cache_usage_perc"])
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    sampler = asyncio.create_task(sample_kv())
    tasks = [asyncio.create_task(run_job(session, url, job, started, scale, started + window_s / scale, result))
             for job, result in zip(jobs, results, strict=True)]
    _, pending = await asyncio.wait(tasks, timeout=(window_s + drain_s) / scale)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ended = time.monotonic()
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    await wait_idle(session, url)
    after = await scrape(session, url)
    # A request that never saw a token waited at least until it was cut: count that wait (a lower bound).
    ttfts = [(r.ttft_s if r.ttft_s is not None else ended - started - j.arrival_s / scale) * scale
             for j, r in zip(jobs, results, strict=True)]
    return {
        "rate": rate, "requests": len(jobs), "unfinished": sum(not r.finished for r in results),
        "throughput_tok_s": sum(r.tokens_in_window for r in results) / window_s,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "kv_mean": sum(kv_samples) / len(kv_samples) if kv_samples else math.nan,
        "kv_max": max(kv_samples, default=math.nan),
        "preemptions": int(after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]),
    }


async def sweep(args: argparse.Namespace) -> list[dict[str, float | int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with simworker_process([port], ["--preset", args.preset, "--time-scale", str(args.time_scale),
                                    "--log-level", "WARNING"]):
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for rate in args.rates:
                rng = random.Random(f"{args.seed}-{rate}")  # each rate's load is reproducible on its own
                row = await run_rate(session, url, rate, args.window_s, args.drain_s, args.time_scale, rng)
                print(f"  rate {rate:g}/s: {row['requests']} requests, {row['throughput_tok_s']:.0f} tok/s, "
                      f"TTFT p99 {row['ttft_p99_s']:.2f}s", flush=True)
                rows.append(row)
    return rows


SWEEP_COLUMNS = [
    Column("rate", "req/s", "{:g}"), Column("requests", "requests", "{:d}"),
    Column("unfinished", "cut", "{:d}"), Column("throughput_tok_s", "out tok/s", "{:.0f}"),
    Column("ttft_p50_s", "TTFT p50 s"), Column("ttft_p99_s", "TTFT p99 s"),
    Column("kv_mean", "KV mean"), Column("kv_max", "KV max"), Column("preemptions", "preempt", "{:d}"),
]
SWEEP_PANELS = [
    Panel("output throughput", ("throughput_tok_s",), "tokens/s"),
    Panel("time to first token", ("ttft_p50_s", "ttft_p99_s"), "seconds", log_y=True),
    Panel("KV cache", ("kv_mean", "kv_max"), "usage (0..1)"),
    Panel("preemptions", ("preemptions",), "count"),
]


# ---------------------------------------------------------------- drift


async def closed_loop_stream(session: aiohttp.ClientSession, url: str, stop_at: float, max_tokens: int,
                             rng: random.Random) -> None:
    while time.monotonic() < stop_at:
        prompt = [rng.randrange(1, 50_000) for _ in range(128)]
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as response:
            async for _ in response.content.iter_any():
                if time.monotonic() >= stop_at:
                    return


async def drift_point(workers: int, streams: int, seconds: float, rng: random.Random) -> dict[str, float | int]:
    ports = [free_port() for _ in range(workers)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    with simworker_process(ports, ["--preset", "h100-80gb", "--log-level", "WARNING"]):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            stop_at = time.monotonic() + 1.0 + seconds
            loops = [asyncio.create_task(closed_loop_stream(session, url, stop_at, 256, rng))
                     for url in urls for _ in range(streams)]
            await asyncio.sleep(1.0)  # let the batches fill
            before = [await scrape(session, url) for url in urls]
            await asyncio.sleep(seconds)
            after = [await scrape(session, url) for url in urls]
            await asyncio.gather(*loops, return_exceptions=True)
    merged_before: dict[str, float] = {}
    merged_after: dict[str, float] = {}
    for merged, scrapes in ((merged_before, before), (merged_after, after)):
        for samples in scrapes:
            for key, value in samples.items():
                merged[key] = merged.get(key, 0.0) + value

    def delta(name: str) -> float:
        return merged_after.get(name, 0.0) - merged_before.get(name, 0.0)

    steps = delta("poolgate_sim_step_lag_seconds_count")
    mean_step_s = delta("poolgate_sim_modelled_step_seconds_total") / steps if steps else math.nan
    mean_lag_s = delta("poolgate_sim_step_lag_seconds_sum") / steps if steps else math.nan
    return {
        "workers": workers, "streams_per_worker": streams, "sequences": workers * streams,
        "steps_per_s": steps / seconds, "tokens_per_s": delta("vllm:generation_tokens_total") / seconds,
        "model_step_ms": mean_step_s * 1000, "lag_mean_ms": mean_lag_s * 1000,
        "lag_p99_ms": lag_quantile(merged_before, merged_after, 0.99) * 1000,
        "lag_share": mean_lag_s / mean_step_s if steps else math.nan,
    }


async def drift(args: argparse.Namespace) -> list[dict[str, float | int]]:
    rng = random.Random(args.seed)
    rows = []
    for workers in args.drift_workers:
        for streams in args.drift_streams:
            row = await drift_point(workers, streams, args.drift_seconds, rng)
            print(f"  {workers} workers x {streams} streams: lag mean {row['lag_mean_ms']:.2f} ms, "
                  f"p99 {row['lag_p99_ms']:.1f} ms, {row['tokens_per_s']:.0f} tok/s", flush=True)
            rows.append(row)
    return rows


DRIFT_COLUMNS = [
    Column("workers", "workers", "{:d}"), Column("streams_per_worker", "streams/w", "{:d}"),
    Column("sequences", "seqs", "{:d}"), Column("steps_per_s", "steps/s", "{:.0f}"),
    Column("tokens_per_s", "tok/s", "{:.0f}"), Column("model_step_ms", "model step ms"),
    Column("lag_mean_ms", "lag mean ms"), Column("lag_p99_ms", "lag p99 ms"),
    Column("lag_share", "lag/step"),
]
DRIFT_PANELS = [
    Panel("step lag", ("lag_mean_ms", "lag_p99_ms"), "ms", log_y=True),
    Panel("delivered tokens", ("tokens_per_s",), "tokens/s"),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer points and shorter windows (~30 s)")
    parser.add_argument("--drift", action="store_true", help="measure the simulator's own step lag instead")
    parser.add_argument("--preset", default="l4-24gb", help="worker preset for the sweep (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=8.0, help="sweep speed-up (default %(default)s)")
    parser.add_argument("--rates", type=float, nargs="+", help="request rates per model second")
    parser.add_argument("--window-s", type=float, help="arrival window per rate, model seconds")
    parser.add_argument("--drain-s", type=float, help="longest wait for stragglers after the window")
    parser.add_argument("--drift-workers", type=int, nargs="+", help="workers per process to try")
    parser.add_argument("--drift-streams", type=int, nargs="+", help="concurrent streams per worker to try")
    parser.add_argument("--drift-seconds", type=float, help="measurement window per drift point")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    args.rates = args.rates or ([0.5, 2.0, 4.0] if args.quick else [0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    args.window_s = args.window_s or (24.0 if args.quick else 60.0)
    args.drain_s = args.drain_s or (40.0 if args.quick else 60.0)
    args.drift_workers = args.drift_workers or ([1, 4] if args.quick else [1, 2, 4, 8])
    args.drift_streams = args.drift_streams or ([16, 64] if args.quick else [8, 32, 128])
    args.drift_seconds = args.drift_seconds or (3.0 if args.quick else 4.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with host_quiet.measure() as quiet:
        rows = asyncio.run(drift(args) if args.drift else sweep(args))
    if args.drift:
        save_rows("sim_drift", rows, DRIFT_COLUMNS, x_key="sequences", panels=DRIFT_PANELS,
                  parameters={k: v for k, v in vars(args).items() if k.startswith("drift")}, host=quiet.stop())
    else:
        save_rows("sim_sweep", rows, SWEEP_COLUMNS, x_key="rate", panels=SWEEP_PANELS,
                  parameters={"preset": args.preset, "time_scale": args.time_scale, "rates": args.rates,
                              "window_s": args.window_s, "drain_s": args.drain_s, "seed": args.seed},
                  host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
