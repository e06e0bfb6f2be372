"""``poolgate bench autoscale --real``: the autoscaler on real processes against a static fleet, same trace.

One ``poolgate``-up-style stack (Redis, controller, extproc, Envoy) serves two pools of simulated workers:
``auto``, which the controller's autoscaler grows and shrinks by launching workers (each loads for
``startup_s`` before its port opens, as a vLLM start does) and draining them, and ``static``, a fixed fleet
sized for the peak (``static_workers``). A compressed diurnal trace — load plateaus from the trough up to
the peak and back, ``peak_to_trough`` = 10, repeated ``cycles`` times — is offered to both pools at once:
every arrival is one streamed chat request to each pool's model, so both see the same requests at the same
moments on the same machine.

With ``sleep_level`` the autoscaled pool gives back its surplus by putting the engine to sleep (vLLM's sleep
mode, simulated: ``wake_up_s`` to wake against ``startup_s`` to start) instead of stopping the process, and with
``standby_workers`` it is deployed with that many spares asleep beside its awake minimum (the trace starts once
they sleep, as it starts once the static fleet serves), so a rise wakes a worker instead of starting one.

Reported per pool: GPU-seconds (seconds each worker process was alive and awake, loading included, read from
/proc and each autoscaled worker's ``/is_sleeping`` every ``SAMPLE_S``; the seconds spent asleep are reported
apart: a level-1 sleeping vLLM has handed its weights and KV cache back to the host but still holds its CUDA
context on the GPU), SLO attainment (share of requests whose time to first token is within ``slo_ttft_s``;
a failed request is a miss), requests lost (an error status, an error or a cut stream; for ``auto`` also
those that ran on a worker drained during the run), and for ``auto`` every scale decision (the controller's
log) with the direction changes inside each plateau. Writes ``autoscale_real.json`` (``"kind": "real"``)
and ``autoscale_real.png`` (offered load, workers alive, decisions; TTFT over time).

The simulated GPUs run on this machine's CPUs: a loaded host slows every engine alike, so the figures compare
the two fleets with each other, not with real GPUs. The defaults take about four minutes in all.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import random
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench import host_quiet
from bench.autoscale_model import reversals
from bench.report import write_report
from poolgate.kernel.config import load_config
from poolgate.up import Stack, StackPorts

SAMPLE_S = 0.5
AUTO, STATIC = "auto", "static"
MODELS = {AUTO: "auto-model", STATIC: "static-model"}
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RealScenario:
    peak_rps: float = 4.0
    """Requests per second offered to each pool at the peak."""
    peak_to_trough: float = 10.0
    levels: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 0.5, 0.25)
    """One cycle's plateaus as shares of the peak (the trough is 1 / ``peak_to_trough``)."""
    plateau_s: float = 15.0
    cycles: int = 2
    startup_s: float = 8.0
    """Model load of every worker the autoscaler starts (a vLLM start takes from seconds to a minute)."""
    max_num_seqs: int = 1
    """Sequences one simulated engine runs at once: one, so a few requests per second fill a worker."""
    output_tokens: int = 12
    time_scale: float = 0.25
    """The simulated GPUs run this many times real time: 4× slower, so a request occupies its worker about
    0.5 s for 12 tokens (the host's CPUs carry a quarter of the chunks a real-time engine would send)."""
    static_workers: int = 3
    """The static fleet: the peak's concurrent requests (``peak_rps`` × ~0.5 s of service) at 70 % of the
    sequences, rounded up."""
    max_workers: int = 4
    slo_ttft_s: float = 2.0
    sleep_level: int = 0
    """0: a surplus worker is stopped; 1 or 2: its engine sleeps at that level and is woken when needed."""
    wake_up_s: float = 1.0
    """What waking a sleeping worker takes (the weights' copy back; tenths of a second to seconds on GPUs)."""
    standby_workers: int = 0
    """With ``sleep_level``: spares the pool keeps asleep (``pools.*.standby_workers``)."""
    worker_capacity: float = 1.0
    """Requests (in flight + queued) one worker carries within the SLO: one sequence at a time, ~0.5 s each.
    Chosen by sweeping the same plateaus through the model (``bench.autoscale``: 0.7, 0.8 and 1.0 with 5- and
    10-s demand windows; 1.0 and 10 s gave the fewest GPU-seconds at ≥ 98 % in the SLO and the fewest
    direction changes); 0 runs the pressure rules alone."""
    seed: int = 11

    def plateaus(self) -> list[tuple[float, float, float]]:
        """(start s, end s, rate) of every plateau: the cycles, then one last trough to see the pool shrink."""
        levels = [max(level, 1 / self.peak_to_trough) for level in self.levels] * self.cycles
        levels.append(1 / self.peak_to_trough)
        return [(i * self.plateau_s, (i + 1) * self.plateau_s, level * self.peak_rps)
                for i, level in enumerate(levels)]

    @property
    def duration_s(self) -> float:
        return self.plateaus()[-1][1]


def arrivals(scenario: RealScenario) -> list[float]:
    """Poisson arrivals at each plateau's rate (the same seeded draw for both pools)."""
    rng = random.Random(scenario.seed)
    times: list[float] = []
    for start, end, rate in scenario.plateaus():
        t = start
        while (t := t + rng.expovariate(rate)) < end:
            times.append(t)
    return times


def stack_config(scenario: RealScenario) -> dict[str, Any]:
    seqs = ["--max-num-seqs", str(scenario.max_num_seqs), "--time-scale", f"{scenario.time_scale:g}"]
    sleeps = ["--enable-sleep-mode", "--wake-up-s", f"{scenario.wake_up_s:g}"] if scenario.sleep_level else []
    return {
        "key_prefix": "bench-autoscale",
        "extproc": {"processes": 1},
        "controller": {"heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 2.0},
        "health": {"probe_interval_s": 0.5, "probe_timeout_s": 2.0, "failures_to_fail": 5},
        "drain": {"grace_s": 60, "settle_s": 1.0, "poll_s": 0.1},
        "scheduling": {"max_wait_s": 30},
        "autoscale": {
            "enabled": True, "interval_s": 1.0, "up_waiting_per_worker": 1.0, "up_sustain_s": 2.0,
            "down_running_per_worker": 0.5 * scenario.max_num_seqs, "down_cooldown_s": 10.0,
            # The start-up time is not given: the controller learns it from the pool's first launches.
            "worker_capacity": scenario.worker_capacity, "demand_window_s": 10.0, "trend_window_s": 30.0,
            "pools": {AUTO: {"min_workers": 1, "max_workers": scenario.max_workers,
                             "sleep_level": scenario.sleep_level,
                             "standby_workers": scenario.standby_workers, "template": {
                "extra_args": [*seqs, "--startup-delay-s", f"{scenario.startup_s:g}", *sleeps]}}},
        },
        "pools": [{"name": AUTO, "model": MODELS[AUTO], "max_model_len": 4096},
                  {"name": STATIC, "model": MODELS[STATIC], "max_model_len": 4096}],
        "workers": [{"id": f"static-{i + 1}", "pool": STATIC, "extra_args": seqs}
                    for i in range(scenario.static_workers)],
    }


@dataclass
class Sent:
    pool: str
    at_s: float
    status: int = 0
    ttft_s: float | None = None
    done: bool = False
    worker: str = ""
    error: str = ""


async def one(session: aiohttp.ClientSession, url: str, pool: str, at_s: float, tokens: int,
              model: str | None = None) -> Sent:
    """One streamed chat request to ``model`` (default: the pool's in this benchmark), timed to its first token."""
    sent = Sent(pool, at_s)
    body = orjson.dumps({"model": model or MODELS[pool], "messages": [{"role": "user", "content": "how are the pools"}],
                         "max_tokens": tokens, "ignore_eos": True, "stream": True})
    started = time.monotonic()
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S), session.post(
                url, data=body, headers={"content-type": "application/json"}) as response:
            sent.status, sent.worker = response.status, response.headers.get("x-poolgate-worker", "")
            if response.status != 200:
                sent.error = (await response.read())[:200].decode(errors="replace")
                return sent
            pending = b""
            async for chunk in response.content.iter_any():
                *events, pending = (pending + chunk).split(b"\n\n")
                for event in events:
                    if sent.ttft_s is None and b'"content":"' in event and b'"content":""' not in event:
                        sent.ttft_s = time.monotonic() - started
                    if event.strip() == b"data: [DONE]":
                        sent.done = True
    except TimeoutError:
        sent.error = "client timeout"
    except (aiohttp.ClientError, OSError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"
    return sent


def worker_processes(controller_pid: int) -> dict[str, int]:
    """Worker id → port of every simulated worker the controller runs (alive now)."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == controller_pid and b"--worker-id" in args:
            found[args[args.index(b"--worker-id") + 1].decode()] = int(args[args.index(b"--port") + 1])
    return found


async def asleep(session: aiohttp.ClientSession, ports: dict[str, int], pool: str = AUTO) -> set[str]:
    """The pool's workers whose engine sleeps now (one that does not answer is counted awake)."""
    async def sleeping(port: int) -> bool:
        try:
            async with asyncio.timeout(1.0), session.get(f"http://127.0.0.1:{port}/is_sleeping") as response:
                return response.status == 200 and bool((await response.json()).get("is_sleeping"))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False

    auto = {w: p for w, p in ports.items() if w.startswith(pool)}
    answers = await asyncio.gather(*(sleeping(p) for p in auto.values()))
    return {w for w, a in zip(auto, answers, strict=True) if a}


@dataclass
class Fleet:
    """Workers alive over time, from /proc samples."""

    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(time s, auto workers alive and awake, static workers alive, auto workers asleep)."""
    seen: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Worker id → (first, last) time it was seen alive."""

    def note(self, at_s: float, alive: dict[str, int], sleeping: set[str] | None = None) -> None:
        sleeping = sleeping or set()
        for worker_id in alive:
            first, _ = self.seen.get(worker_id, (at_s, at_s))
            self.seen[worker_id] = (first, at_s)
        auto = {w for w in alive if w.startswith(AUTO)}
        self.samples.append((at_s, len(auto - sleeping), sum(w.startswith(STATIC) for w in alive),
                             len(auto & sleeping)))

    def gpu_seconds(self, pool: str) -> float:
        """Seconds each of the pool's workers was alive and awake from the trace's start until its last request
        ended (the same window for both pools): sample counts × the sample period."""
        index = 1 if pool == AUTO else 2
        return sum(SAMPLE_S * sample[index] for sample in self.samples if sample[0] >= 0)

    def asleep_seconds(self) -> float:
        """Seconds the autoscaled pool's workers spent asleep (alive, not counted as GPU-seconds)."""
        return sum(SAMPLE_S * sample[3] for sample in self.samples if sample[0] >= 0)


async def watch_fleet(controller_pid: int, start: float, stop: asyncio.Event, fleet: Fleet,
                      session: aiohttp.ClientSession) -> None:
    while not stop.is_set():
        alive = await asyncio.to_thread(worker_processes, controller_pid)
        fleet.note(time.monotonic() - start, alive, await asleep(session, alive))
        await asyncio.sleep(SAMPLE_S)


async def deployed(session: aiohttp.ClientSession, controller_pid: int, scenario: RealScenario) -> None:
    """Wait until the autoscaled pool's standby spares sleep (its deployment, as the static fleet's start is)."""
    deadline = time.monotonic() + 2 * scenario.startup_s + 60.0
    while scenario.standby_workers:
        alive = await asyncio.to_thread(worker_processes, controller_pid)
        if len(await asleep(session, alive)) >= scenario.standby_workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the autoscaled pool's {scenario.standby_workers} standby workers were not asleep "
                               f"{2 * scenario.startup_s + 60.0:.0f} s after the stack served")
        await asyncio.sleep(SAMPLE_S)


DECISION = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*pool auto: scale (up|down) to (\d+) \((.*)\)$")
DRAINING = re.compile(r"pool auto: \d+ -> \d+ workers, draining (.+)$")


def log_time(stamp: str) -> float:
    """Epoch seconds of a controller log line's timestamp."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def decisions(controller_log: str, wall_start: float) -> tuple[list[dict[str, Any]], set[str]]:
    """The autoscaler's scale decisions for ``auto`` (time from the trace's start) and the workers drained."""
    found: list[dict[str, Any]] = []
    drained: set[str] = set()
    for line in controller_log.splitlines():
        if (match := DECISION.match(line)) is not None:
            at = log_time(match[1]) - wall_start
            found.append({"at_s": round(at, 2), "action": match[2], "target": int(match[3]), "reason": match[4]})
        elif (drain := DRAINING.search(line)) is not None:
            drained.update(w.strip() for w in drain[1].split(","))
    return found, drained


STARTED = re.compile(r"pool auto: worker \S+ served ([\d.]+) s after it was first seen starting")
WOKE = re.compile(r"pool auto: .* woke .* in ([\d.]+) s, started")


def lifecycle_times(controller_log: str) -> dict[str, list[float]]:
    """Seconds each launch took to serve and each wake-up took, as the controller measured them."""
    return {"startups_s": [float(m[1]) for m in STARTED.finditer(controller_log)],
            "wakeups_s": [float(m[1]) for m in WOKE.finditer(controller_log)]}


def direction_changes(scenario: RealScenario, made: Sequence[dict[str, Any]]) -> list[int]:
    """Per plateau: how often the direction of consecutive scale decisions inside it reversed."""
    changes = []
    for start, end, _ in scenario.plateaus():
        changes.append(reversals([d["action"] for d in made if start <= d["at_s"] < end]))
    return changes


def pool_figures(pool: str, sent: Sequence[Sent], fleet: Fleet, scenario: RealScenario,
                 drained: set[str]) -> dict[str, Any]:
    mine = [s for s in sent if s.pool == pool]
    ok = [s for s in mine if s.status == 200 and s.done]
    lost = [s for s in mine if not (s.status == 200 and s.done)]
    inside = sum(1 for s in ok if s.ttft_s is not None and s.ttft_s <= scenario.slo_ttft_s)
    ttfts = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
    counts = [sample[1 if pool == AUTO else 2] for sample in fleet.samples if sample[0] >= 0]
    return {
        "requests": len(mine), "gpu_seconds": round(fleet.gpu_seconds(pool), 1),
        "slo_attainment": round(inside / len(mine), 5) if mine else math.nan,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], 3) if ttfts else None,
        "lost": len(lost), "lost_on_drained_workers": sum(1 for s in lost if s.worker in drained),
        "lost_examples": [f"{s.status} {s.error}"[:160] for s in lost[:5]],
        "workers_min": min(counts) if counts else 0, "workers_max": max(counts) if counts else 0,
        "asleep_seconds": round(fleet.asleep_seconds(), 1) if pool == AUTO else 0.0,
    }


async def run(scenario: RealScenario, run_dir: Path) -> dict[str, Any]:
    config_path = run_dir / "poolgate.yaml"
    config_path.write_text(yaml.safe_dump(stack_config(scenario)))
    ports = StackPorts.all_free(extproc_processes=1)
    stack = Stack(load_config(config_path), config_path, run_dir, ports, None, "127.0.0.1")
    fleet = Fleet()
    times = arrivals(scenario)
    try:
        await stack.start()
        await stack.wait_until_serving()
        controller_pid = next(c.process.pid for c in stack.children if c.name == "controller")
        url = stack.base_url + "/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.sleep(2.0)  # the autoscaler's first samples of an idle pool at its minimum
            await deployed(session, controller_pid, scenario)
            start, wall_start = time.monotonic(), time.time()
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_fleet(controller_pid, start, stop, fleet, session))
            tasks = []
            for at in times:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                for pool in (AUTO, STATIC):
                    tasks.append(asyncio.create_task(one(session, url, pool, at, scenario.output_tokens)))
            sent = list(await asyncio.gather(*tasks))
            stop.set()
            await watcher
        controller_log = (run_dir / "controller.log").read_text()
        made, drained = decisions(controller_log, wall_start)
        measured = lifecycle_times(controller_log)
    finally:
        await stack.stop()
    auto = pool_figures(AUTO, sent, fleet, scenario, drained)
    static = pool_figures(STATIC, sent, fleet, scenario, drained)
    changes = direction_changes(scenario, made)
    ratio = auto["gpu_seconds"] / static["gpu_seconds"] if static["gpu_seconds"] else math.nan
    targets = {
        "gpu_seconds_ratio_at_most_0.6": ratio <= 0.6,
        "slo_attainment_at_least_99pct_and_static": auto["slo_attainment"] >= 0.99
        and auto["slo_attainment"] >= static["slo_attainment"],
        "no_request_lost_at_scale_down": auto["lost_on_drained_workers"] == 0,
        "at_most_one_direction_change_per_plateau": max(changes, default=0) <= 1,
    }
    return {
        "kind": "real", "scenario": asdict(scenario), "policy": stack_config(scenario)["autoscale"],
        "load_average": os.getloadavg(), "auto": auto, "static": static,
        "gpu_seconds_ratio": round(ratio, 4), "targets": targets,
        "decisions": made, "drained_workers": sorted(drained), "direction_changes_per_plateau": changes,
        **measured,
        "plateaus": [{"start_s": s, "end_s": e, "rps": round(r, 3)} for s, e, r in scenario.plateaus()],
        "fleet": [list(sample) for sample in fleet.samples],
        "requests": [asdict(s) for s in sent],
        "run_dir": str(run_dir),
    }


def plot(report: dict[str, Any], axes: list[Any]) -> None:
    """Offered load, workers alive and scale decisions over time; every request's TTFT over time."""
    timeline, ttft_axis = axes
    plateaus = report["plateaus"]
    xs = [p["start_s"] for p in plateaus] + [plateaus[-1]["end_s"]]
    load = [p["rps"] for p in plateaus] + [plateaus[-1]["rps"]]
    timeline.step(xs, load, where="post", color="grey", label="offered req/s (each pool)")
    load_axis = timeline
    workers_axis = timeline.twinx()
    fleet = report["fleet"]
    workers_axis.step([f[0] for f in fleet], [f[1] for f in fleet], where="post", label="auto workers awake")
    workers_axis.step([f[0] for f in fleet], [f[2] for f in fleet], where="post", label="static workers alive")
    if any(len(f) > 3 and f[3] for f in fleet):
        workers_axis.step([f[0] for f in fleet], [f[3] for f in fleet], where="post", linestyle=":",
                          label="auto workers asleep")
    for decision in (d for d in report["decisions"] if d["at_s"] >= 0):
        marker = "^" if decision["action"] == "up" else "v"
        workers_axis.plot(decision["at_s"], decision["target"], marker, color="black")
    workers_axis.set_ylabel("workers")
    load_axis.set_xlabel("time (s)")
    load_axis.set_ylabel("req/s")
    load_axis.set_title(f"GPU-seconds auto/static {report['gpu_seconds_ratio']:.2f}; ▲▼ decisions")
    workers_axis.legend(loc="upper right", fontsize=7)
    load_axis.legend(loc="upper left", fontsize=7)
    for pool in (AUTO, STATIC):
        points = [(r["at_s"], r["ttft_s"] if r["ttft_s"] is not None else 60.0) for r in report["requests"]
                  if r["pool"] == pool]
        ttft_axis.scatter([p[0] for p in points], [p[1] for p in points], s=3,
                          label=f"{pool}: {report[pool]['slo_attainment']:.1%} in SLO")
    ttft_axis.axhline(report["scenario"]["slo_ttft_s"], color="red", linewidth=0.8, label="TTFT SLO")
    ttft_axis.set_yscale("log")
    ttft_axis.set_xlabel("sent at (s)")
    ttft_axis.set_ylabel("TTFT (s; failed at 60)")
    ttft_axis.legend(fontsize=7)


def summary_lines(report: dict[str, Any]) -> list[str]:
    scenario = report["scenario"]
    lines = [
        "# Autoscaling on real processes vs a static fleet sized for the peak",
        "",
        f"Trace: plateaus {scenario['levels']} × {scenario['peak_rps']:g} req/s (peak/trough "
        f"{scenario['peak_to_trough']:g}), {scenario['plateau_s']:g} s each, {scenario['cycles']} cycles + a last "
        f"trough ({report['plateaus'][-1]['end_s']:.0f} s); worker start-up {scenario['startup_s']:g} s"
        + (f", surplus to sleep at level {scenario['sleep_level']} (wake-up {scenario['wake_up_s']:g} s)"
           if scenario.get("sleep_level") else ", surplus stopped")
        + (f", {scenario['standby_workers']} standby asleep from the start" if scenario.get("standby_workers") else "")
        + "; TTFT SLO "
        f"{scenario['slo_ttft_s']:g} s; load average {', '.join(f'{x:.1f}' for x in report['load_average'])}.",
        "",
        host_quiet.describe(report.get("host")) + ".",
        "",
        "| fleet | workers awake (min–max) | GPU-seconds (asleep) | SLO attainment | TTFT p50 | TTFT p99 | requests "
        "| lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pool in (STATIC, AUTO):
        figures = report[pool]
        lines.append(f"| {pool} | {figures['workers_min']}–{figures['workers_max']} | {figures['gpu_seconds']:,.0f} "
                     f"({figures.get('asleep_seconds', 0.0):,.0f}) | "
                     f"{figures['slo_attainment']:.2%} | {figures['ttft_p50_s']} s | {figures['ttft_p99_s']} s | "
                     f"{figures['requests']} | {figures['lost']} ({figures['lost_on_drained_workers']} on drained "
                     "workers) |")
    lines += ["", f"GPU-seconds auto/static: {report['gpu_seconds_ratio']:.2f}; decisions: "
                  f"{len(report['decisions'])} ({sum(d['action'] == 'up' for d in report['decisions'])} up); "
                  f"direction changes per plateau: {report['direction_changes_per_plateau']}.",
              _lifecycle_line(report),
              "Targets: " + ", ".join(f"{name} {'met' if met else 'MISSED'}"
                                      for name, met in report["targets"].items())]
    return lines


def _lifecycle_line(report: dict[str, Any]) -> str:
    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.2f} s (n = {len(values)})" if values else "none"

    return (f"Measured by the controller: start-up (launch to serving) {mean(report.get('startups_s', []))}; "
            f"wake-up {mean(report.get('wakeups_s', []))}.")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The trace's options (``poolgate bench autoscale --real``); defaults take about four minutes."""
    defaults = RealScenario()
    parser.add_argument("--plateau-s", type=float, default=defaults.plateau_s,
                        help="seconds of each load plateau (default %(default)s)")
    parser.add_argument("--cycles", type=int, default=defaults.cycles,
                        help="trough → peak → trough cycles (default %(default)s)")
    parser.add_argument("--startup-s", type=float, default=defaults.startup_s,
                        help="model load of each autoscaled worker (default %(default)s)")
    parser.add_argument("--peak-rps", type=float, default=defaults.peak_rps,
                        help="requests per second to each pool at the peak (default %(default)s)")
    parser.add_argument("--static-workers", type=int, default=defaults.static_workers,
                        help="size of the static fleet (default %(default)s: sized for the peak)")
    parser.add_argument("--max-workers", type=int, default=defaults.max_workers,
                        help="the autoscaled pool's max_workers (default %(default)s)")
    parser.add_argument("--slo-ttft-s", type=float, default=defaults.slo_ttft_s,
                        help="TTFT SLO in seconds (default %(default)s)")
    parser.add_argument("--sleep-level", type=int, choices=(0, 1, 2), default=defaults.sleep_level,
                        help="0: stop surplus workers; 1 or 2: put their engines to sleep at that level "
                             "(default %(default)s)")
    parser.add_argument("--wake-up-s", type=float, default=defaults.wake_up_s,
                        help="what waking a sleeping worker takes (default %(default)s)")
    parser.add_argument("--standby-workers", type=int, default=None,
                        help="spares the autoscaled pool keeps asleep (default: with --sleep-level, max-workers - 1, "
                             "the whole surplus; else 0)")
    parser.add_argument("--worker-capacity", type=float, default=defaults.worker_capacity,
                        help="requests one worker carries within the SLO, for capacity planning (0 = the "
                             "pressure rules alone; default %(default)s)")


def run_real(args: argparse.Namespace) -> int:
    """Run with parsed options (``--out`` and ``--seed`` come from ``bench.autoscale``'s parser)."""
    out = Path(args.out)
    scenario = RealScenario(plateau_s=args.plateau_s, cycles=args.cycles, startup_s=args.startup_s,
                            peak_rps=args.peak_rps, static_workers=args.static_workers,
                            max_workers=args.max_workers, slo_ttft_s=args.slo_ttft_s,
                            worker_capacity=args.worker_capacity, sleep_level=args.sleep_level,
                            wake_up_s=args.wake_up_s, seed=args.seed,
                            standby_workers=(args.standby_workers if args.standby_workers is not None
                                             else args.max_workers - 1 if args.sleep_level else 0))
    began = time.monotonic()
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(scenario, Path(tempfile.mkdtemp(prefix="poolgate-bench-autoscale-"))))
    report["wall_s"] = round(time.monotonic() - began, 1)
    report = host_quiet.attach(report, quiet.stop())
    write_report("autoscale_real", report, plot, panels=2, directory=out)
    lines = summary_lines(report)
    (out / "autoscale_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"took {report['wall_s']:.0f} s")
    return 0
