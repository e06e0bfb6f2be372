"""``poolgate bench tenants --out DIR [--quick]``: does a gold tenant keep its latency while bronze bursts?

One pool of simulated L4 workers behind ``poolgate up`` with two keyed tenants: gold (class ``high``) and
bronze (class ``low``, with a concurrency limit and a tokens-per-minute limit of 10 % of the fleet's
tokens). The fleet's capacity C (requests/s of the fixed request shape) is measured first with a closed
loop, after a warm-up. Then, on a fresh stack:

1. gold alone, open loop (Poisson) at 0.4 C;
2. gold again at 0.4 C, the same arrival times, while bronze sends 3 C.

Every request that gets through adds a prefill to some engine step, which lengthens the first token of
whatever else is in that step: gold's TTFT with the burst rises with the share of the fleet bronze is
allowed, which the operator sets (its tokens-per-minute limit, ``lower_class_inflight_fraction``). The
workers' own TTFT and how far the simulated GPUs lagged real time are reported per phase to separate
the modelled fleet from this machine's CPUs.

Reported: gold's p99 TTFT in 2 over 1 (target ≤ 1.25×), bronze's answers (429s vs client timeouts: the
target is that excess is shed with 429 and nothing times out), and per tenant the real tokens (the usage
the workers report, asked with ``include_usage``) in the busiest 60 s window over its tokens-per-minute
limit (with ``--quick`` the phases are shorter than a minute, so this is the phase's total: a lower bound).
Results: ``DIR/tenants.json``, ``DIR/tenants.png`` (gold's TTFT distributions, bronze's outcomes) and a
short text summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench import host_quiet
from bench.harness import lag_quantile, scrape
from bench.measure import percentile
from bench.report import write_report
from extproc.tenancy import key_digest
from poolgate.kernel.config import load_config
from poolgate.procs import free_port
from poolgate.up import Stack, StackPorts

MODEL = "bench-chat"
KEYS = {"gold": "pg-bench-gold", "bronze": "pg-bench-bronze"}
PROMPT_WORDS = 200
OUTPUT_TOKENS = 64
CLIENT_TIMEOUT_S = 30.0
GOLD_SEED = 1
BRONZE_TPM_SHARE = 0.1
"""Bronze's tokens-per-minute limit as a share of the fleet's capacity."""
PRESET = "l4-24gb"
"""A slow card, so the fleet's capacity is set by the modelled GPUs, not by this machine's CPUs running the
load generator, Envoy and extproc: the burst must stress the fleet, not the benchmark harness."""
CAPACITY_CONCURRENCY_PER_WORKER = 32
"""Sequences a worker runs at once (``--max-num-seqs``), the closed-loop clients per worker when measuring
capacity, and the gate's per-worker concurrency target."""


@dataclass
class Result:
    tenant: str
    sent_at: float
    status: int = 0
    ttft_s: float | None = None
    done_at: float | None = None
    total_tokens: int = 0
    timed_out: bool = False
    error: str = ""
    refusal: str = ""
    """The error code of a non-200 answer (``tokens_per_minute``, ``queue_deadline``, ...)."""


def config(ports: Sequence[int], bronze_tpm: int, gold_tpm: int, bronze_concurrency: int) -> dict[str, Any]:
    return {
        "key_prefix": "bench-tenants",
        "controller": {"heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 5.0},
        "pools": [{"name": "chat", "model": MODEL}],
        "workers": [{"id": f"chat-{i}", "pool": "chat", "preset": PRESET, "port": port,
                     "extra_args": ["--log-level", "WARNING",
                                    "--max-num-seqs", str(CAPACITY_CONCURRENCY_PER_WORKER)]}
                    for i, port in enumerate(ports)],
        # The saturation gate: bronze (low) fills a worker only to a quarter of the concurrency the fleet's
        # capacity was measured at; the rest is gold's headroom, and bronze's excess waits in extproc's queue.
        "scheduling": {"max_wait_s": 5.0, "max_inflight_per_worker": CAPACITY_CONCURRENCY_PER_WORKER,
                       "lower_class_inflight_fraction": 0.25, "queue_when_waiting": True},
        "tenancy": {
            "require_api_key": True,
            "priority_classes": [{"name": "high", "max_wait_s": 20.0}, {"name": "standard"},
                                 {"name": "low", "max_wait_s": 2.0}],
            "max_queued": 500,
        },
        "tenants": [
            {"name": "gold", "api_key_sha256": [key_digest(KEYS["gold"])], "priority": "high",
             "tokens_per_minute": gold_tpm},
            {"name": "bronze", "api_key_sha256": [key_digest(KEYS["bronze"])], "priority": "low",
             "max_concurrent": bronze_concurrency, "tokens_per_minute": bronze_tpm},
        ],
    }


def body(seed: int) -> bytes:
    rng = random.Random(seed)
    words = " ".join(rng.choice(("data", "node", "pool", "queue", "token", "time")) for _ in range(PROMPT_WORDS))
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}],
                         "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})


async def one(session: aiohttp.ClientSession, url: str, tenant: str, seed: int, start: float) -> Result:
    loop = asyncio.get_running_loop()
    result = Result(tenant, loop.time() - start)
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}
    sent = loop.time()
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with session.post(url, data=body(seed), headers=headers) as response:
                result.status = response.status
                if response.status != 200:
                    result.refusal = refusal_code(await response.read())
                    return result
                pending = b""
                async for chunk in response.content.iter_any():
                    *events, pending = (pending + chunk).split(b"\n\n")
                    for event in events:
                        read_event(result, event, loop.time() - sent)
                result.done_at = loop.time() - start
    except TimeoutError:
        result.timed_out = True
    except (aiohttp.ClientError, OSError) as exc:
        result.error = type(exc).__name__
    return result


def refusal_code(body: bytes) -> str:
    """The ``error.code`` of an OpenAI-style error body ("?" when there is none)."""
    try:
        return str(orjson.loads(body)["error"]["code"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "?"


def read_event(result: Result, event: bytes, elapsed_s: float) -> None:
    """Note the first token's time and the reported usage from one SSE event.

    The first event of a chat stream carries only the role (vLLM sends it at once); TTFT is the first event
    with generated text."""
    if not event.startswith(b"data: {"):
        return
    data = orjson.loads(event[6:])
    choices = data.get("choices") or ()
    if result.ttft_s is None and any((c.get("delta") or {}).get("content") for c in choices):
        result.ttft_s = elapsed_s
    if data.get("usage"):
        result.total_tokens = int(data["usage"].get("total_tokens") or 0)


async def open_loop(session: aiohttp.ClientSession, url: str, tenant: str, rate: float, duration_s: float,
                    start: float, seed: int) -> list[Result]:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tasks = []
    due = 0.0
    while (due := due + rng.expovariate(rate)) < duration_s:
        await asyncio.sleep(max(0.0, start + due - loop.time()))
        tasks.append(asyncio.create_task(one(session, url, tenant, rng.randrange(1 << 30), start)))
    return list(await asyncio.gather(*tasks))


async def capacity(session: aiohttp.ClientSession, url: str, warmup_s: float, duration_s: float,
                   concurrency: int) -> float:
    """Requests per second completed by ``concurrency`` back-to-back gold clients, counted after a warm-up
    (until the first requests finish, completions undercount the steady rate)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (warmup_s, warmup_s + duration_s)
    done = 0

    async def client(index: int) -> None:
        nonlocal done
        seed = index * 10_000
        while loop.time() - start < window[1]:
            seed += 1
            result = await one(session, url, "gold", seed, start)
            if result.status == 200 and result.done_at is not None and window[0] <= result.done_at <= window[1]:
                done += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done / duration_s


def p99(values: Sequence[float]) -> float | None:
    """Nearest-rank p99 (bench.measure's), None when nothing was measured."""
    return percentile(values, 0.99) if values else None


def busiest_minute(results: Sequence[Result]) -> float:
    """Real tokens in the busiest 60 s window (by completion time); all of them when the phase is shorter."""
    done = sorted((r.done_at, r.total_tokens) for r in results if r.done_at is not None)
    best = total = 0
    left = 0
    for right in range(len(done)):
        total += done[right][1]
        while done[right][0] - done[left][0] > 60:
            total -= done[left][1]
            left += 1
        best = max(best, total)
    return float(best)


def summarise(results: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and not r.timed_out]
    return {"sent": len(results), "ok": len(ok), "http_429": sum(r.status == 429 for r in results),
            "other_status": sum(r.status not in (0, 200, 429) for r in results),
            "client_timeouts": sum(r.timed_out for r in results), "errors": sum(bool(r.error) for r in results),
            "refusals": dict(Counter(r.refusal for r in results if r.refusal)),
            "p99_ttft_s": p99([r.ttft_s for r in ok if r.ttft_s is not None])}


async def run(quick: bool) -> dict[str, Any]:
    workers, phase_s, measure_s = (2, 20.0, 10.0) if quick else (2, 150.0, 30.0)
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-bench-tenants-"))
    tokens_per_request = PROMPT_WORDS + 8 + OUTPUT_TOKENS
    # Limits are set after measuring capacity; start with generous ones for the measurement.
    config_path = run_dir / "poolgate.yaml"
    ports = [free_port() for _ in range(workers)]
    config_path.write_text(yaml.safe_dump(config(ports, 10**9, 10**9, 10**6)))
    stack = await start_stack(config_path, run_dir)
    try:
        url = stack.base_url + "/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            fleet_rps = await capacity(session, url, warmup_s=10.0, duration_s=measure_s,
                                       concurrency=CAPACITY_CONCURRENCY_PER_WORKER * workers)
    finally:
        await stack.stop()
    gold_rate, bronze_rate = 0.4 * fleet_rps, 3.0 * fleet_rps
    gold_tpm = int(fleet_rps * 60 * tokens_per_request)  # never binding at 40 %
    # Below the share the gate would leave bronze, so the tokens-per-minute limit, not the gate, binds it.
    bronze_tpm = int(BRONZE_TPM_SHARE * fleet_rps * 60 * tokens_per_request)
    config_path.write_text(yaml.safe_dump(config(ports, bronze_tpm, gold_tpm, bronze_concurrency=32 * workers)))
    stack = await start_stack(config_path, run_dir)
    try:
        url = stack.base_url + "/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            loop = asyncio.get_running_loop()
            worker_urls = [f"http://127.0.0.1:{port}" for port in ports]
            before = await worker_histograms(session, worker_urls)
            start = loop.time()
            # Gold's arrivals are the same draw in both phases, so the two latency figures compare like for like.
            alone = await open_loop(session, url, "gold", gold_rate, phase_s, start, GOLD_SEED)
            middle = await worker_histograms(session, worker_urls)
            await asyncio.sleep(5)
            paused = await worker_histograms(session, worker_urls)
            start = loop.time()
            gold, bronze = await asyncio.gather(open_loop(session, url, "gold", gold_rate, phase_s, start, GOLD_SEED),
                                                open_loop(session, url, "bronze", bronze_rate, phase_s, start, 3))
            after = await worker_histograms(session, worker_urls)
    finally:
        await stack.stop()
    phases = {"gold_alone": summarise(alone), "gold_with_burst": summarise(gold), "bronze_burst": summarise(bronze)}
    phases["gold_alone"].update(worker_figures(before, middle))
    phases["gold_with_burst"].update(worker_figures(paused, after))
    alone_p99, burst_p99 = phases["gold_alone"]["p99_ttft_s"], phases["gold_with_burst"]["p99_ttft_s"]
    report = {
        "quick": quick, "workers": workers, "phase_s": phase_s, "fleet_capacity_rps": fleet_rps,
        "gold_rate_rps": gold_rate, "bronze_rate_rps": bronze_rate,
        "limits": {"gold_tpm": gold_tpm, "bronze_tpm": bronze_tpm, "bronze_max_concurrent": 32 * workers},
        "phases": phases,
        "gold_p99_ratio": (burst_p99 / alone_p99) if alone_p99 and burst_p99 else None,
        "tpm_overshoot": {
            "gold": busiest_minute(gold) / gold_tpm - 1,
            "bronze": busiest_minute(bronze) / bronze_tpm - 1,
        },
        "results": {"alone": [asdict(r) for r in alone], "gold": [asdict(r) for r in gold],
                    "bronze": [asdict(r) for r in bronze]},
    }
    return report


WORKER_HISTOGRAMS = {"sim_step_lag": "poolgate_sim_step_lag_seconds",
                     "worker_ttft": "vllm:time_to_first_token_seconds"}


async def worker_histograms(session: aiohttp.ClientSession, worker_urls: Sequence[str]) -> dict[str, float]:
    """The workers' step-lag and TTFT histogram buckets, summed over workers."""
    merged: dict[str, float] = {}
    prefixes = tuple(f"{name}_bucket|" for name in WORKER_HISTOGRAMS.values())
    for samples in await asyncio.gather(*(scrape(session, url) for url in worker_urls)):
        for key, value in samples.items():
            if key.startswith(prefixes):
                merged[key] = merged.get(key, 0.0) + value
    return merged


def worker_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the workers saw during a phase: how far the simulated GPUs fell behind real time (this machine's
    CPUs, not the modelled fleet) and the engine-side TTFT of every request (both tenants)."""
    return {f"{name}_{label}_ms": lag_quantile(before, after, share, histogram) * 1000
            for name, histogram in WORKER_HISTOGRAMS.items() for label, share in (("p50", 0.5), ("p99", 0.99))}


async def start_stack(config_path: Path, run_dir: Path) -> Stack:
    config = load_config(config_path)
    stack = Stack(config, config_path, run_dir, StackPorts.all_free(config.extproc.process_count()), None,
                  "127.0.0.1")
    await stack.start()
    await stack.wait_until_serving()
    async with aiohttp.ClientSession() as session:  # READY with keys required: wait for a keyed answer too
        deadline = time.monotonic() + 60
        while (await one(session, stack.base_url + "/chat/completions", "gold", 0, 0.0)).status != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack does not serve keyed requests (logs in {run_dir})")
            await asyncio.sleep(0.2)
    return stack


def plot(report: dict[str, Any], axes: list[Any]) -> None:
    """Gold's TTFT distribution alone and under the burst; what became of every bronze request."""
    ttft_axis, outcome_axis = axes
    for key, label in (("alone", "gold alone"), ("gold", "gold with bronze burst")):
        ttfts = sorted(r["ttft_s"] for r in report["results"][key] if r["ttft_s"] is not None)
        ttft_axis.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label)
    ttft_axis.set_xlabel("TTFT (s)")
    ttft_axis.set_ylabel("share of requests")
    ttft_axis.set_title(f"gold TTFT; p99 ratio {report['gold_p99_ratio'] or float('nan'):.2f}x")
    ttft_axis.legend()
    bronze = report["phases"]["bronze_burst"]
    names = ("ok", "http_429", "client_timeouts", "other_status", "errors")
    outcome_axis.bar(names, [bronze[name] for name in names])
    outcome_axis.tick_params(axis="x", labelrotation=20)
    outcome_axis.set_title(f"bronze burst: {bronze['sent']} requests")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poolgate bench tenants", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="short phases (about a minute in all)")
    args = parser.parse_args(argv)
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(args.quick))
    write_report("tenants", report, plot, panels=2, directory=args.out, host=quiet.stop())
    phases = report["phases"]
    print(f"fleet capacity {report['fleet_capacity_rps']:.1f} req/s; gold {report['gold_rate_rps']:.1f} req/s, "
          f"bronze {report['bronze_rate_rps']:.1f} req/s")
    for name, phase in phases.items():
        print(f"  {name:16} {json.dumps(phase)}")
    ratio = report["gold_p99_ratio"]
    print(f"gold p99 TTFT with burst / alone: {ratio:.2f}× (target ≤ 1.25×)" if ratio else "gold p99: n/a")
    print("TPM overshoot: " + ", ".join(f"{k} {v:+.1%}" for k, v in report["tpm_overshoot"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
