"""``poolgate bench soak --chaos``: the mixed workload at ``--load`` of the measured capacity for ``--minutes``
while the stack of ``bench.chaos`` loses, in turn, a worker, an extproc process, the leading controller,
the Redis master (a Sentinel failover), and a worker's speed. ``--short`` checks it all in a few minutes.

Capacity is measured first as ``bench.capacity`` does for the benchmark fleets: closed-loop clients over
the mix, doubled until completed requests per second grow by less than 5 %; the best step is the
capacity. The soak then sends the mix open-loop (Poisson arrivals) at ``--load`` of it. Requests keep
their class's real mode: non-streaming requests are sent with ``stream: false`` (the router may retry them
on another worker; a stream that has started cannot be), streams are followed by the hang detector of
``bench.soak_measure``. A quarter of the requests carry the key of a tenant with a tokens-per-minute limit
whose counters are read from Redis through the run and compared with the usage its answers reported.

Targets: ≥ 99.9 % of non-streaming requests succeed, no stream hangs, no quota drift beyond what requests
cut after admission explain, RSS of every process within ±10 % over the last two thirds of the run (the
last 20 minutes of 30).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import host_quiet
from bench.chaos import FAULTS, KEY_PREFIX, MODELS, POOL_MAX_MODEL_LEN, QUOTA_TENANT, REDIS_FAULT, ChaosStack, FaultPlan
from bench.harness import answers_chat
from bench.loadgen import Counters, Target, new_session, run_closed_loop
from bench.report import Column, format_table, write_report
from bench.soak_measure import (
    HUNG,
    NON_STREAMING,
    STREAMING,
    TOTAL_TOKENS,
    MemorySample,
    QuotaLedger,
    Sent,
    class_rows,
    memory_rows,
    per_minute,
    read_stream,
    rss_mib,
)
from bench.workload import RequestSpec, poisson_trace, request_body
from poolgate.kernel.keys import QuotaKeys
from poolgate.kernel.outage import REDIS_ERRORS

TARGET_NON_STREAMING = 0.999
RSS_TOLERANCE = 0.10
STREAM_IDLE_S = 60.0
"""A stream silent this long counts as hung (generous: a loaded 2-core host stalls for seconds)."""
STREAM_TOTAL_S = 300.0
NON_STREAMING_TIMEOUT_S = 180.0
QUOTA_SHARE = 4
"""Every QUOTA_SHARE-th request is the quota tenant's."""


def _body(spec: RequestSpec) -> bytes:
    body = orjson.loads(request_body(spec, MODELS[spec.role]))
    if not spec.nominal_stream:
        body["stream"] = False
        body.pop("stream_options", None)
    return orjson.dumps(body)


async def send(session: aiohttp.ClientSession, base: str, spec: RequestSpec, body: bytes, sent: Sent,
               api_key: str | None) -> None:
    """One request; every way it can end is written into ``sent``."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    started = time.monotonic()
    try:
        if sent.mode == STREAMING:
            async with session.post(base + spec.path, data=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as response:
                sent.status = response.status
                if response.status != 200:
                    await response.read()
                    sent.error = f"HTTP {response.status}"
                    return
                end = await read_stream(response.content.iter_any(), idle_s=STREAM_IDLE_S, total_s=STREAM_TOTAL_S)
                sent.end, sent.ttft_s, sent.usage_tokens = end.end, end.ttft_s, end.usage_tokens
                sent.ok = end.end == "completed"
                sent.error = "" if sent.ok else f"stream {end.end}"
                if end.end == HUNG:
                    response.close()
            return
        async with session.post(base + spec.path, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=NON_STREAMING_TIMEOUT_S)) as response:
            sent.status = response.status
            answer = await response.read()
            sent.ok = response.status == 200 and b'"choices"' in answer
            if sent.ok:
                sent.ttft_s = time.monotonic() - started
                found = TOTAL_TOKENS.search(answer)
                sent.usage_tokens = int(found.group(1)) if found else None
            else:
                sent.error = f"HTTP {response.status}"
    except TimeoutError:
        sent.error = "timed out"
        if sent.mode == STREAMING:
            sent.end = HUNG
    except aiohttp.ClientError as exc:
        sent.error = type(exc).__name__
        if sent.mode == STREAMING:
            sent.end = "cut"
    finally:
        sent.elapsed_s = time.monotonic() - started


async def measure_capacity(session: aiohttp.ClientSession, base: str, *, warmup_s: float, window_s: float,
                           first_clients: int = 4, max_steps: int = 6, min_gain: float = 0.05) -> dict[str, Any]:
    """Completed requests per second of the mix with closed-loop clients, doubled until the gain is small."""
    trace = poisson_trace(1.0, 4000.0, seed=11)
    bodies = [request_body(spec, MODELS[spec.role]) for spec in trace]
    steps: list[dict[str, float]] = []
    clients = first_clients
    saturated = False
    for _ in range(max_steps):
        _, outcomes = await run_closed_loop(session, Target.single("poolgate", base), trace, bodies,
                                            concurrency=clients, warmup_s=warmup_s, window_s=window_s,
                                            counters=Counters())
        done = sum(o.completed and o.e2e_s is not None and warmup_s <= o.sent_s + o.e2e_s < warmup_s + window_s
                   for o in outcomes)
        steps.append({"clients": clients, "completions_per_s": done / window_s,
                      "errors": sum(o.error is not None for o in outcomes)})
        print(f"soak: capacity with {clients} clients: {done / window_s:.2f} completed req/s", flush=True)
        best_before = max((s["completions_per_s"] for s in steps[:-1]), default=0.0)
        if best_before and steps[-1]["completions_per_s"] < best_before * (1 + min_gain):
            saturated = True
            break
        clients *= 2
    best = max(steps, key=lambda s: s["completions_per_s"])
    return {"rps": best["completions_per_s"], "clients": best["clients"], "steps": steps, "saturated": saturated}


async def _wait_serving(session: aiohttp.ClientSession, stack: ChaosStack, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        registered = all(w.registered_pid is not None for w in stack.workers)
        statuses = [await answers_chat(session, stack.base_url, model) for model in MODELS.values()]
        if registered and all(s == 200 for s in statuses):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the chaos stack did not serve within {timeout_s:.0f} s (logs in {stack.run_dir})")


async def _every(seconds: float, action: Any, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):
            await action()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


def _sample_memory(stack: ChaosStack, start: float, samples: list[MemorySample]) -> None:
    now = time.monotonic() - start
    for service, pid in stack.pids().items():
        rss = rss_mib(pid)
        if rss is not None:
            samples.append(MemorySample(now, service, pid, rss))


async def _read_quota(stack: ChaosStack, ledger: QuotaLedger, first_minute: int) -> int | None:
    """Read the tenant's minute counters; returns the concurrency slots it holds (None: Redis away)."""
    keys = QuotaKeys(KEY_PREFIX)
    redis = stack.open_redis()
    try:
        minutes = list(range(first_minute, int(time.time() // 60) + 1))
        values = await redis.mget([keys.tokens(QUOTA_TENANT, m) for m in minutes])
        for minute, value in zip(minutes, values, strict=True):
            ledger.observe(minute, int(value) if value is not None else None)
        return int(await redis.zcard(keys.concurrent(QUOTA_TENANT)))
    except REDIS_ERRORS:
        return None
    finally:
        await redis.aclose()


async def _soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    stack = ChaosStack(out / "run")
    stop = asyncio.Event()
    async with new_session() as session:
        await stack.start()
        supervisor = asyncio.ensure_future(stack.supervise(session))
        try:
            await _wait_serving(session, stack)
            capacity = await measure_capacity(session, stack.base_url, warmup_s=args.calibrate_warmup_s,
                                              window_s=args.calibrate_s)
            rate = capacity["rps"] * args.load
            seconds = args.minutes * 60
            print(f"soak: capacity {capacity['rps']:.2f} req/s; sending {rate:.2f} req/s for {args.minutes:g} min, "
                  f"a fault every {args.fault_every_s:g} s ({', '.join(FAULTS)})", flush=True)
            trace = poisson_trace(rate, seconds, seed=7)
            ledger = QuotaLedger(QUOTA_TENANT, max(POOL_MAX_MODEL_LEN.values()))
            first_minute = int(time.time() // 60)
            samples: list[MemorySample] = []
            plan = FaultPlan(stack, args.fault_every_s, first_s=min(args.fault_every_s, seconds / 4))
            start = time.monotonic()
            ledger.epoch_s = time.time()
            load_average_start = os.getloadavg()
            background = [
                asyncio.ensure_future(_every(args.sample_s, lambda: _memory_now(stack, start, samples), stop)),
                asyncio.ensure_future(_every(15.0, lambda: _read_quota(stack, ledger, first_minute), stop)),
                asyncio.ensure_future(_every(0.5, lambda: plan.tick(session, time.monotonic() - start), stop)),
            ]
            sent: list[Sent] = []
            tasks: list[asyncio.Task[None]] = []
            for spec in trace:
                delay = start + spec.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = Sent(STREAMING if spec.nominal_stream else NON_STREAMING, spec.workload,
                              time.monotonic() - start)
                quota = spec.index % QUOTA_SHARE == 0
                record.tenant = QUOTA_TENANT if quota else ""
                sent.append(record)
                tasks.append(asyncio.create_task(send(session, stack.base_url, spec, _body(spec), record,
                                                      stack.quota_key if quota else None)))
            await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
            load_average_end = os.getloadavg()
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            print(f"soak: sending done ({len(sent)} requests); waiting for the last answers", flush=True)
            if tasks:
                await asyncio.wait(tasks, timeout=STREAM_TOTAL_S + 10)
            await plan.settle()
            await asyncio.sleep(2.0)  # the last releases reach Redis
            _sample_memory(stack, start, samples)
            slots = await _read_quota(stack, ledger, first_minute)
        finally:
            stack.stop()
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
    return {"capacity": capacity, "rate_rps": rate, "sent": sent, "ledger": ledger, "samples": samples,
            "faults": plan.events, "restarts": dict(stack.restarts), "quota_slots_left": slots,
            "heartbeat_failures": stack.heartbeat_failures,
            "load_average": {"start": load_average_start, "end": load_average_end}, "seconds": seconds}


async def _memory_now(stack: ChaosStack, start: float, samples: list[MemorySample]) -> None:
    _sample_memory(stack, start, samples)


def report(args: argparse.Namespace, out: Path, run: dict[str, Any], host: host_quiet.HostQuiet | None = None) -> bool:
    sent: list[Sent] = run["sent"]
    classes = class_rows(sent)
    minutes = per_minute(sent)
    memory = memory_rows(run["samples"], window_from_s=run["seconds"] / 3, tolerance=RSS_TOLERANCE)
    # The bookkeeping is at risk for the requests in flight when an extproc process or the Redis master is
    # killed (a correction never written, a reply lost and the call counted twice); admissions made while
    # no master answered keep their charges until it does.
    outages = [(e.at_s, e.at_s) for e in run["faults"] if e.fault in ("extproc", REDIS_FAULT)]
    quota = run["ledger"].verdict(sent, outages)
    quota_minutes = run["ledger"].minutes(sent, outages)
    non_streaming = next(r for r in classes if r["class"] == NON_STREAMING)
    streaming = next(r for r in classes if r["class"] == STREAMING)
    success = float(non_streaming["success_pct"]) / 100 if non_streaming["sent"] else math.nan
    checks = {
        "non_streaming_success": success >= TARGET_NON_STREAMING,
        "no_stream_hung": streaming.get(HUNG, 0) == 0,
        "no_quota_drift": bool(quota["no_drift"]),
        "rss_within_10pct": all(row["within"] is not False for row in memory),
    }
    faults = [asdict(event) for event in run["faults"]]
    data = {"name": "soak-chaos", "parameters": {k: v for k, v in vars(args).items() if k != "out"},
            "capacity": run["capacity"], "rate_rps": run["rate_rps"], "classes": classes, "minutes": minutes,
            "memory": memory, "quota": quota, "quota_minutes": quota_minutes,
            "quota_slots_left": run["quota_slots_left"], "faults": faults,
            "restarts": run["restarts"], "heartbeat_failures": run["heartbeat_failures"],
            "load_average": run["load_average"], "checks": checks, "passed": all(checks.values()),
            "lost": [{**asdict(s), "after_fault": _last_fault(faults, s.sent_s + s.elapsed_s)}
                     for s in sent if not s.ok]}
    lost_by_fault: dict[tuple[str, str], int] = {}
    for lost in data["lost"]:
        key = (lost["after_fault"], lost["mode"])
        lost_by_fault[key] = lost_by_fault.get(key, 0) + 1
    lost_rows: list[dict[str, Any]] = [{"after": after, "class": mode, "lost": n}
                                       for (after, mode), n in sorted(lost_by_fault.items())]
    data["lost_by_fault"] = lost_rows
    tables = [
        format_table(classes, [Column("class", "class", "{}"), Column("sent", "sent", "{}"),
                               Column("succeeded", "ok", "{}"), Column("failed", "failed", "{}"),
                               Column("success_pct", "success %", "{:.3f}"), Column("completed", "completed", "{}"),
                               Column("error event", "error event", "{}"), Column("cut", "cut", "{}"),
                               Column(HUNG, "hung", "{}"), Column("errors", "errors", "{}")]),
        format_table(minutes, [Column("minute", "minute", "{}"), Column("requests", "requests", "{}"),
                               Column("failed", "failed", "{}"),
                               Column("stream_p99_ttft_ms", "stream p99 TTFT ms", "{:.0f}"),
                               Column("non_stream_p99_ttft_ms", "non-stream p99 answer ms", "{:.0f}")]),
        format_table(faults, [Column("at_s", "at s", "{:.0f}"), Column("fault", "fault", "{}"),
                              Column("target", "target", "{}"), Column("back_after_s", "back after s", "{:.1f}"),
                              Column("note", "note", "{}")]),
        format_table(memory, [Column("process", "process", "{}"), Column("start_mib", "RSS start MiB", "{:.1f}"),
                              Column("end_mib", "RSS end MiB", "{:.1f}"), Column("incarnations", "processes", "{}"),
                              Column("window_change_pct", "last 2/3 change %", "{:+.1f}"),
                              Column("within", "within ±10 %", "{}")]),
        format_table(lost_rows or [{"after": "-", "class": "-", "lost": 0}],
                     [Column("after", "lost after fault", "{}"), Column("class", "class", "{}"),
                      Column("lost", "requests", "{}")]),
        format_table([quota], [Column("tenant", "quota tenant", "{}"), Column("requests", "requests", "{}"),
                               Column("usage_reported_tokens", "usage reported", "{}"),
                               Column("counted_tokens", "counted in Redis", "{}"),
                               Column("drift_tokens", "drift", "{:+d}"),
                               Column("at_risk_requests", "requests at risk", "{}"),
                               Column("drift_pct", "drift %", "{:+.2f}"),
                               Column("drift_bound_tokens", "bound", "{}")]),
        format_table(quota_minutes, [Column("minute", "quota minute", "{}"), Column("counted", "counted", "{}"),
                                     Column("reported", "reported", "{}"), Column("drift", "drift", "{:+d}"),
                                     Column("at_risk", "at risk", "{}")]),
    ]
    load = run["load_average"]
    saturated = "" if run["capacity"]["saturated"] else ", a lower bound: the sweep ended still growing"
    summary = (f"chaos soak {args.minutes:g} min at {run['rate_rps']:.2f} req/s ({args.load:.0%} of "
               f"{run['capacity']['rps']:.2f}{saturated}), {len(faults)} faults; load average {load['start'][0]:.1f} → "
               f"{load['end'][0]:.1f}; quota slots left {run['quota_slots_left']}; heartbeat rounds failed "
               f"{run['heartbeat_failures']}\n" + "\n".join(f"  {name}: {'yes' if ok else 'NO'}"
                                                           for name, ok in checks.items())
               + f"\n{host_quiet.describe(host.as_dict() if host else None)}"
               + f"\n→ {'PASS' if data['passed'] else 'FAIL'}")
    text = "\n\n".join([*tables, summary])
    (out / "soak-chaos.md").write_text(f"# Chaos soak\n\n```\n{text}\n```\n")
    print(text)
    write_report("soak-chaos", data, lambda report_data, axes: _plot(report_data, run, axes), panels=2,
                 directory=out, host=host)
    return bool(data["passed"])


def _last_fault(faults: list[dict[str, Any]], at_s: float) -> str:
    """The last fault before a request failed (what most likely cost it)."""
    before = [f for f in faults if f["at_s"] <= at_s]
    return f"{before[-1]['fault']} {before[-1]['target']} at {before[-1]['at_s']:.0f} s" if before else "none"


def _plot(data: dict[str, Any], run: dict[str, Any], axes: list[Any]) -> None:
    ttft, rss = axes
    xs = [row["minute"] for row in data["minutes"]]
    for key, label in (("stream_p99_ttft_ms", "streams: first token"),
                       ("non_stream_p99_ttft_ms", "non-streaming: answer")):
        ttft.plot(xs, [row[key] for row in data["minutes"]], marker="o", label=label)
    for event in data["faults"]:
        ttft.axvline(event["at_s"] / 60 + 1, color="grey", alpha=0.3)
    ttft.set_title("p99 per minute (grey: faults)")
    ttft.set_xlabel("minute")
    ttft.set_ylabel("ms")
    ttft.set_yscale("log")
    ttft.legend(fontsize="small")
    for service in dict.fromkeys(s.service for s in run["samples"]):
        mine = [s for s in run["samples"] if s.service == service]
        rss.plot([s.at_s / 60 for s in mine], [s.rss_mib for s in mine], label=service)
    rss.set_title("RSS per process")
    rss.set_xlabel("minute")
    rss.set_ylabel("MiB")
    rss.legend(fontsize="x-small", ncol=2)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with host_quiet.measure() as quiet:
        result = asyncio.run(_soak(args, out))
    return 0 if report(args, out, result, quiet.stop()) else 1
