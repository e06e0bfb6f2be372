"""``poolgate bench xds_change --workers N… --pools P…``: one worker's change from the xDS server to a real Envoy.

Only the xDS server (in this process) and one Envoy run, nothing else: the floor under the one-change
latency ``poolgate bench scale`` measures through the whole stack. The fleet (N workers in P pools, the
fallback's period as the controller has it) is sent once; then a worker turns Draining and back, one at a
time, and each change counts from ``XdsServer.update`` until Envoy's ``membership_healthy`` gauge of the
worker's cluster moved (polled every 2 ms, gauges of that cluster only). At 10,000 workers in one cluster
most of it is Envoy taking a 10,000-host assignment (``--endpoint-shards 1``; by default such a pool is split
as the controller's warning asks, one cluster per 1,000 workers). A change that lands while Envoy takes the
fallback's assignment (every usable worker, sent on its own at most once a second) waits for it. "fleet in
Envoy" counts from Envoy's admin port answering until it lists the whole fleet. Results go to
``bench/reports/xds_change.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import host_quiet
from bench.harness import ProcessGroup
from bench.measure import percentile
from bench.report import Column, Panel, save_rows
from bench.scale import auto_shards, clusters_of, envoy_healthy
from controller.xds import XdsServer
from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import worker_cluster
from poolgate.procs import envoy_binary, free_port, wait_port

POLL_S = 0.002
WAIT_S = 30.0


def record(index: int, pools: int, state: WorkerState = WorkerState.READY) -> WorkerRecord:
    return WorkerRecord(id=f"w{index:05d}", pool=f"p{index % pools}", model="m",
                        host=f"127.1.{index // 250}.{index % 250 + 1}", port=9000, state=state)


async def until(http: aiohttp.ClientSession, admin: str, clusters: list[str], target: int) -> None:
    """Poll until the healthy count over ``clusters`` is ``target``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if await envoy_healthy(http, admin, clusters) == target:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"envoy never showed {target} healthy hosts in {len(clusters)} clusters")
        await asyncio.sleep(POLL_S)


async def measure(n: int, pools: int, changes: int, run_dir: Path, shards: int = 0) -> dict[str, Any]:
    shards = shards or auto_shards(-(-n // pools))
    config = parse_config({"pools": [{"name": f"p{i}", "model": "m", "endpoint_shards": shards}
                                     for i in range(pools)]})
    server = XdsServer(config.pools)
    fleet = {f"w{i:05d}": record(i, pools) for i in range(n)}
    server.update(fleet)
    group = ProcessGroup(run_dir)
    try:
        xds_port = await server.start("127.0.0.1", 0)
        admin_port = free_port()
        bootstrap = render_bootstrap(config, node_id="xds-change", listen_port=free_port(), admin_port=admin_port,
                                     extproc_port=free_port(), xds_port=xds_port)
        path = run_dir / f"envoy-{n}-{pools}.json"
        path.write_text(json.dumps(bootstrap))
        group.start(f"envoy-{n}-{pools}", [str(envoy_binary()), "-c", str(path), "-l", "error",
                                           "--use-dynamic-base-id", "--disable-hot-restart", "--concurrency", "1"])
        await wait_port("127.0.0.1", admin_port, 30)
        admin = f"http://127.0.0.1:{admin_port}"
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            await until(http, admin, clusters_of([pool.name for pool in config.pools], shards), n)
            first_s = time.monotonic() - started
            latencies = []
            for k in range(changes):
                index = n - 1 - k
                worker = fleet[f"w{index:05d}"]
                own = [worker_cluster(worker.pool, worker.id, shards)]
                for state, step in ((WorkerState.DRAINING, -1), (WorkerState.READY, 1)):
                    target = await envoy_healthy(http, admin, own) + step
                    fleet[worker.id] = record(index, pools, state)
                    sent = time.monotonic()
                    server.update(fleet, [worker.id])
                    await until(http, admin, own, target)
                    latencies.append(time.monotonic() - sent)
                await asyncio.sleep(0.2)
    finally:
        group.stop_all()
        await server.stop(0.1)
    row = {"workers": n, "pools": pools, "endpoint_shards": shards, "first_push_s": first_s,
           "change_p50_ms": percentile(latencies, 0.5) * 1000,
           "change_p99_ms": percentile(latencies, 0.99) * 1000}
    print(json.dumps(row), flush=True)
    return row


COLUMNS = [Column("workers", "workers", "{}"), Column("pools", "pools", "{}"),
           Column("endpoint_shards", "shards", "{}"),
           Column("first_push_s", "fleet in Envoy s", "{:.2f}"), Column("change_p50_ms", "change p50 ms", "{:.1f}"),
           Column("change_p99_ms", "change p99 ms", "{:.1f}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 200])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--endpoint-shards", type=int, default=0,
                        help="clusters per pool; 0 = one per 1,000 workers of a pool past 2,000")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-xds-change-"))
    with host_quiet.measure() as quiet:
        rows = [asyncio.run(measure(n, p, args.changes, run_dir, args.endpoint_shards))
                for p in args.pools for n in args.workers]
    save_rows("xds_change", rows, COLUMNS, x_key="workers",
              panels=[Panel("one change, xDS server to Envoy", ("change_p50_ms", "change_p99_ms"), "ms")],
              parameters=vars(args), host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
