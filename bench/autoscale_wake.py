"""``poolgate bench autoscale --wake-ups``: how long the first request to a pool with no awake worker waits.

Two autoscaled pools of simulated workers, both with ``min_workers: 0`` and one worker at most, behind one real
stack (Redis, controller, extproc, Envoy): ``cold`` stops its idle worker, so its next request waits for a
launch (the engine loads for ``startup_s`` before its port opens, as a vLLM start does); ``sleepy`` puts its
idle worker's engine to sleep (vLLM's sleep mode, simulated: ``wake_up_s`` to wake), so its next request waits
for a wake-up. Each round sends one streamed request to each pool, measures its time to first token from the
client, then waits until the pool has no awake worker again (the process gone, or the engine asleep). The
``sleepy`` pool's first round is a launch too (nothing sleeps yet).

Reported per round: the client's TTFT, when the controller acted on the request (launch or wake-up call), and
what the engine took (a launch: process started to its first good ``/health``; a wake-up: the ``/wake_up``
call), both from the controller's log, so the wait splits into the engine's own start or wake and what poolgate
added (the autoscaler noticing the waiting request, registration, Envoy learning the endpoint, the prefill).
Targets (the autoscaling issue): served within the start-up + 1 s from zero, within 2 s from sleep.
Writes ``autoscale_wake.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import host_quiet
from bench.autoscale_real import asleep, log_time, one, worker_processes
from bench.report import write_report
from poolgate.kernel.config import load_config
from poolgate.up import Stack, StackPorts

COLD, SLEEPY = "cold", "sleepy"
MODELS = {COLD: "cold-model", SLEEPY: "sleepy-model"}
REPLY_TOKENS = 4
IDLE_WAIT_S = 120.0
"""Longest a round waits for a pool to have no awake worker again."""


@dataclass(frozen=True)
class WakeScenario:
    rounds: int = 3
    startup_s: float = 8.0
    """Model load of every launched worker."""
    wake_up_s: float = 1.0
    """What waking the sleeping engine takes."""
    idle_s: float = 3.0
    """The pools' ``down_cooldown_s``: how soon an idle worker is stopped or put to sleep."""


@dataclass
class Round:
    pool: str
    round: int
    kind: str
    """``launch`` (nothing alive) or ``wake-up`` (the engine slept)."""
    ttft_s: float | None
    status: int
    acted_s: float | None
    """From the request sent to the controller's launch or wake-up call (its log)."""
    engine_s: float | None
    """What the engine took, from the controller's log: a launch from the process started to its first good
    ``/health``, a wake-up its ``/wake_up`` call. None when the log has no such line."""
    worker: str = ""


def stack_config(scenario: WakeScenario) -> dict[str, Any]:
    def template(*more: str) -> dict[str, Any]:
        return {"extra_args": ["--startup-delay-s", f"{scenario.startup_s:g}", *more]}

    return {
        "key_prefix": "bench-wake",
        "extproc": {"processes": 1},
        "controller": {"heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 2.0},
        "health": {"probe_interval_s": 0.5, "probe_timeout_s": 2.0, "failures_to_fail": 5},
        "drain": {"grace_s": 30, "settle_s": 0.5, "poll_s": 0.1},
        "autoscale": {
            "enabled": True, "interval_s": 1.0, "down_cooldown_s": scenario.idle_s, "up_sustain_s": 1.0,
            "worker_capacity": 1.0, "demand_window_s": 2.0, "trend_window_s": 10.0,
            "pools": {
                COLD: {"min_workers": 0, "max_workers": 1, "cold_start_wait_s": 120, "template": template()},
                SLEEPY: {"min_workers": 0, "max_workers": 1, "cold_start_wait_s": 120, "sleep_level": 1,
                         "template": template("--enable-sleep-mode", "--wake-up-s", f"{scenario.wake_up_s:g}")},
            },
        },
        "pools": [{"name": pool, "model": model, "max_model_len": 4096} for pool, model in MODELS.items()],
        "workers": [],
    }


async def awake_workers(session: aiohttp.ClientSession, controller_pid: int, pool: str) -> set[str]:
    alive = {w: p for w, p in (await asyncio.to_thread(worker_processes, controller_pid)).items()
             if w.startswith(pool)}
    return set(alive) - await asleep(session, alive, pool)


async def wait_idle(session: aiohttp.ClientSession, controller_pid: int, pool: str) -> None:
    deadline = time.monotonic() + IDLE_WAIT_S
    while await awake_workers(session, controller_pid, pool):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool {pool} still has an awake worker after {IDLE_WAIT_S:g} s")
        await asyncio.sleep(0.25)
    await asyncio.sleep(1.0)  # the record's sleep level or the removal reaches extproc


LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?"
                  r"(pool (\S+): 0 -> 1 workers, woke (\S+)(?: in ([\d.]+) s)?, started (\S+)"
                  r"|worker (\S+) is ready at)")


def lifecycle(controller_log: str, pool: str, sent_at: float) -> tuple[float | None, float | None]:
    """For the request sent at ``sent_at`` (epoch s): how long the controller took to act on it (launch or wake
    call), and what the engine then took: a launch from the process started to its first good ``/health``, a
    wake-up its ``/wake_up`` call. None where the log has no such line after ``sent_at``."""
    acted: tuple[float, str, float | None] | None = None
    for line in controller_log.splitlines():
        match = LINE.match(line)
        if match is None or log_time(match[1]) < sent_at - 1.0:
            continue
        if acted is None and match[3] == pool:
            woke = match[4] != "none"
            acted = (log_time(match[1]), "" if woke else match[6], float(match[5]) if woke and match[5] else None)
            if woke:  # logged once the call returned
                return acted[0] - (acted[2] or 0.0) - sent_at, acted[2]
        elif acted is not None and match[7] == acted[1]:
            return acted[0] - sent_at, log_time(match[1]) - acted[0]
    return (acted[0] - sent_at if acted else None), None


async def run(scenario: WakeScenario, run_dir: Path) -> dict[str, Any]:
    config_path = run_dir / "poolgate.yaml"
    config_path.write_text(yaml.safe_dump(stack_config(scenario)))
    stack = Stack(load_config(config_path), config_path, run_dir, StackPorts.all_free(extproc_processes=1), None,
                  "127.0.0.1")
    rounds: list[Round] = []
    try:
        await stack.start()
        await stack.wait_until_serving()
        controller_pid = next(c.process.pid for c in stack.children if c.name == "controller")
        url = stack.base_url + "/chat/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            await asyncio.sleep(2.0)
            for index in range(scenario.rounds):
                for pool in (COLD, SLEEPY):
                    alive = {w for w in await asyncio.to_thread(worker_processes, controller_pid)
                             if w.startswith(pool)}
                    kind = "wake-up" if alive else "launch"
                    sent_at = time.time()
                    sent = await one(session, url, pool, 0.0, REPLY_TOKENS, model=MODELS[pool])
                    ttft, status, worker = sent.ttft_s, sent.status, sent.worker
                    await wait_idle(session, controller_pid, pool)
                    acted_s, engine_s = lifecycle((run_dir / "controller.log").read_text(), pool, sent_at)
                    rounds.append(Round(pool, index + 1, kind, ttft, status, acted_s, engine_s, worker))
                    print(f"{pool} round {index + 1}: {kind}, TTFT {ttft if ttft is None else round(ttft, 2)} s "
                          f"(acted after {acted_s} s, engine {engine_s} s)", flush=True)
    finally:
        await stack.stop()
    return {"kind": "real-wake-ups", "scenario": asdict(scenario), "policy": stack_config(scenario)["autoscale"],
            "rounds": [asdict(r) for r in rounds], "targets": targets(scenario, rounds), "run_dir": str(run_dir)}


def targets(scenario: WakeScenario, rounds: list[Round]) -> dict[str, bool]:
    launches = [r for r in rounds if r.kind == "launch"]
    wakes = [r for r in rounds if r.kind == "wake-up"]
    return {
        "from_zero_within_startup_plus_1s": bool(launches) and all(
            r.status == 200 and r.ttft_s is not None and r.engine_s is not None and r.ttft_s <= r.engine_s + 1.0
            for r in launches),
        "from_sleep_within_2s": bool(wakes) and all(r.status == 200 and r.ttft_s is not None and r.ttft_s <= 2.0
                                                   for r in wakes),
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    scenario = report["scenario"]
    lines = ["# First request to a pool with no awake worker: a launch against a wake-up", "",
             f"Engine load {scenario['startup_s']:g} s, wake-up {scenario['wake_up_s']:g} s; "
             + host_quiet.describe(report.get("host")) + ".", "",
             "| pool | round | waited for | TTFT (client) | controller acted after | engine's start or wake "
             "| poolgate's share |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        ttft = f"{r['ttft_s']:.2f} s" if r["ttft_s"] is not None else f"none ({r['status']})"
        engine = f"{r['engine_s']:.2f} s" if r["engine_s"] is not None else "—"
        share = (f"{r['ttft_s'] - r['engine_s']:+.2f} s" if r["ttft_s"] is not None and r["engine_s"] is not None
                 else "—")
        acted = f"{r['acted_s']:.2f} s" if r["acted_s"] is not None else "—"
        lines.append(f"| {r['pool']} | {r['round']} | {r['kind']} | {ttft} | {acted} | {engine} | {share} |")
    lines += ["", "Targets: " + ", ".join(f"{name} {'met' if met else 'MISSED'}"
                                          for name, met in report["targets"].items())]
    return lines


def plot(report: dict[str, Any], axis: Any) -> None:
    """Each round's client TTFT beside what the engine took to start or wake."""
    rounds = report["rounds"]
    labels = [f"{r['pool']} {r['round']}\n{r['kind']}" for r in rounds]
    xs = range(len(rounds))
    axis.bar([x - 0.2 for x in xs], [r["ttft_s"] or 0.0 for r in rounds], width=0.4, label="TTFT (client)")
    axis.bar([x + 0.2 for x in xs], [r["engine_s"] or 0.0 for r in rounds], width=0.4,
             label="the engine's start-up or wake-up")
    axis.set_xticks(list(xs), labels, fontsize=7)
    axis.set_ylabel("seconds")
    axis.legend(fontsize=7)


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    defaults = WakeScenario()
    parser.add_argument("--wake-ups", action="store_true",
                        help="measure the first request to a pool at zero: a launch against a wake-up "
                             "(``bench.autoscale_wake``): autoscale_wake.json, .md and .png")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="requests to each pool, each after it went idle (--wake-ups; default %(default)s)")


def run_wake_ups(args: argparse.Namespace) -> int:
    """Run with parsed options (``--startup-s`` and ``--wake-up-s`` shared with ``--real``)."""
    out = Path(args.out)
    scenario = WakeScenario(rounds=args.rounds, startup_s=args.startup_s, wake_up_s=args.wake_up_s)
    began = time.monotonic()
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(scenario, Path(tempfile.mkdtemp(prefix="poolgate-bench-wake-"))))
    report["wall_s"] = round(time.monotonic() - began, 1)
    report["load_average"] = os.getloadavg()
    report = host_quiet.attach(report, quiet.stop())
    write_report("autoscale_wake", report, plot, panels=1, directory=out)
    lines = summary_lines(report)
    (out / "autoscale_wake.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
