"""``poolgate bench health_rounds --workers N… --hung H``: the health monitor alone: the CPU it spends per probe,
how long its rounds take, and how soon it fails H workers that hang at once.

The controller's ``HealthMonitor`` runs in this process (on uvloop, as in the controller) against a redis-server
of its own and two fake-worker servers (``bench.scale serve-workers``: every worker an address on loopback), and
nothing else: the floor under ``poolgate bench scale``'s mass-hang figure, where the monitor shares two cores with
the whole stack. For each fleet size: the N workers are registered and judged Ready, then ``--steady-s`` of rounds
give the mean round time, the probes sent per second and this process's CPU time per probe; then the server of H
of them is stopped (SIGSTOP: its connections stay open and nothing answers, a hung engine) and the time counts
until the monitor wrote all H Failed in Redis. With ``--trials K`` the hang is repeated K times, each after the
workers came back and a random part of a round later: how soon they leave depends on where in the round the
hang falls (they are probed together, at the round's start), between a probe timeout plus two half intervals
(the confirmations that overlap it) and a round more. It also counts those early confirmations, in the steady
phase (where none should be sent) and in the hangs. Results go to ``bench/reports/health_rounds.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import uvloop

from bench import host_quiet
from bench.harness import ProcessGroup
from bench.redis_deployments import RedisServer
from bench.report import Column, Panel, save_rows
from bench.scale import MODEL, fleet
from controller.monitor import HealthMonitor, MonitorStats, run_monitor
from controller.probe import HttpProber
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port, wait_port

POOLS = 50
WAIT_S = 120.0


def records(n: int, pools: int, hung: int, healthy_port: int, hung_port: int) -> list[WorkerRecord]:
    """``bench scale``'s fleet as registry records; the first ``hung`` on the server that will be stopped."""
    return [WorkerRecord(id=w.id, pool=w.pool, model=MODEL, host=w.host, port=w.port)
            for w in fleet(n, pools, hung, healthy_port, hung_port)]


async def until(condition: Any, what: str) -> float:
    """Seconds until ``condition()`` holds, polled every 20 ms."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > WAIT_S:
            raise RuntimeError(f"{what}: not within {WAIT_S:g} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def failed(stats: MonitorStats) -> int:
    return sum(count for key, count in stats.transitions.items() if key.endswith("->Failed"))


def recovered(stats: MonitorStats) -> int:
    return sum(count for key, count in stats.transitions.items() if key.startswith("Failed->"))


async def measure(n: int, hung: int, steady_s: float, run_dir: Path, trials: int = 1,
                  probes_per_s: float | None = None) -> dict[str, Any]:
    health = {"max_probes_per_s": probes_per_s} if probes_per_s else {}
    config = parse_config({"pools": [{"name": f"p{i}", "model": MODEL} for i in range(POOLS)], "health": health})
    redis_server = RedisServer()
    client = aioredis.from_url(redis_server.url)
    group = ProcessGroup(run_dir)
    stop = asyncio.Event()
    prober = HttpProber(config.health.probe_timeout_s, config.health.check_models)
    try:
        ports = free_port(), free_port()
        servers = [group.start(f"workers-{port}", [sys.executable, "-m", "bench.scale", "serve-workers", str(port)])
                   for port in ports]
        for port in ports:
            await wait_port("127.0.0.1", port, 30)
        store = FleetStore(client, "bench-health")
        await store.register_many(records(n, POOLS, hung, *ports), ttl_s=3600)
        monitor = HealthMonitor(store, config.health, config.extproc.stale_after_s, prober)
        monitoring = asyncio.create_task(run_monitor(monitor, config.health.probe_interval_s, stop))
        stats = monitor.stats
        await until(lambda: stats.rounds >= 3, "three rounds")
        rounds, probes, failures, early = stats.rounds, stats.probes, stats.probe_failures, stats.early_confirmations
        cpu, wall = time.process_time(), time.monotonic()
        round_times = []
        while time.monotonic() - wall < steady_s:
            await until(lambda before=stats.rounds: stats.rounds > before, "a round")
            round_times.append(stats.last_round_s)
        probed = stats.probes - probes
        spent, elapsed = time.process_time() - cpu, time.monotonic() - wall
        row: dict[str, Any] = {
            "workers": n, "hung": hung, "rounds": stats.rounds - rounds,
            "round_s": sum(round_times) / len(round_times), "probes_s": probed / elapsed,
            "cpu_us_per_probe": spent / probed * 1e6, "cpu_cores": spent / elapsed,
            "steady_failures": stats.probe_failures - failures,
            "steady_early_confirmations": stats.early_confirmations - early}
        failed_before, given_back, early = failed(stats), stats.slots_given_back, stats.early_confirmations
        outs = []
        back = recovered(stats)
        for trial in range(trials):
            if trial:  # back in, then a random point of a round
                await until(lambda b=back: recovered(stats) - b >= hung, "every hung worker back")
                await asyncio.sleep(random.uniform(0, row["round_s"]))
            before = failed(stats)
            os.kill(servers[1].pid, signal.SIGSTOP)
            outs.append(await until(lambda b=before: failed(stats) - b >= hung, "every hung worker Failed"))
            back = recovered(stats)
            os.kill(servers[1].pid, signal.SIGCONT)
        row["hung_out_s"] = max(outs)
        row["hung_out_min_s"] = min(outs)
        row["hung_out_all_s"] = [round(out, 2) for out in outs]
        row["slots_given_back"] = stats.slots_given_back - given_back
        row["early_confirmations"] = stats.early_confirmations - early
        row["wrongly_failed"] = failed(stats) - failed_before - hung * trials
        stop.set()
        await monitoring
    finally:
        stop.set()
        prober.close()
        group.stop_all()
        await client.aclose()
        redis_server.stop()
    print(json.dumps(row), flush=True)
    return row


COLUMNS = [Column("workers", "workers", "{}"), Column("hung", "hung", "{}"), Column("round_s", "round s", "{:.2f}"),
           Column("probes_s", "probes/s", "{:.0f}"), Column("cpu_us_per_probe", "CPU µs/probe", "{:.0f}"),
           Column("cpu_cores", "monitor cores", "{:.2f}"), Column("hung_out_min_s", "hung out min s", "{:.2f}"),
           Column("hung_out_s", "hung out max s", "{:.2f}"),
           Column("steady_failures", "failed probes (steady)", "{}"),
           Column("slots_given_back", "slots given back", "{}"), Column("wrongly_failed", "wrongly failed", "{}"),
           Column("steady_early_confirmations", "early confirmations steady", "{}"),
           Column("early_confirmations", "early confirmations in hangs", "{}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--hung", type=int, default=1000, help="workers that hang at once (at most half the fleet)")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=1, help="hangs in a row, each at a random point of a round")
    parser.add_argument("--max-probes-per-s", type=float, default=None, help="health.max_probes_per_s (default: the "
                        "config's)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-health-rounds-"))
    freeze_startup_objects()  # the collector set as the controller sets it: its CPU per probe is what is measured
    with host_quiet.measure() as quiet:
        rows = [uvloop.run(measure(n, min(args.hung, n // 2), args.steady_s, run_dir, args.trials,
                                   args.max_probes_per_s))
                for n in args.workers]
    save_rows("health_rounds", rows, COLUMNS, x_key="workers",
              panels=[Panel("time", ("round_s", "hung_out_s"), "s"),
                      Panel("monitor CPU per probe", ("cpu_us_per_probe",), "µs")],
              parameters=vars(args), host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
