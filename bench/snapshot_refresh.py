"""extproc's fleet refresh alone: ``FleetWatcher.refresh`` over an in-memory store of 10,000 workers.

Times, per fleet shape (one pool; 200 pools serving 25 models, as ``pick_microbench``'s ``10k-workers``),
the median of: a full build of the snapshot (``build_snapshot`` of every record: what each refresh cost
when it rebuilt everything), a refresh with one changed worker, a refresh with nothing changed, and the
refresh half a staleness bound after the last new snapshot (the fleet is vouched for again: a re-dated
snapshot now, a copy of every record before). The store answers from memory, so the figures are the
refresh's own Python, without Redis round trips.

    .venv/bin/poolgate bench snapshot_refresh [--repeats 30]

Results print as a table and go to ``bench/reports/snapshot_refresh.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import host_quiet
from bench.report import Column, Panel, save_rows
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.snapshot import build_snapshot
from extproc.watcher import FleetWatcher
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import ChangePoll

WORKERS = 10_000
NOW = 1_000_000.0


class MemoryStore:
    """The part of ``FleetStore`` the watcher's refresh reads, answered from a dict."""

    def __init__(self, records: Sequence[WorkerRecord]) -> None:
        self.records = {record.id: record for record in records}
        self.version = 1
        self._changed: set[str] = set()

    def change(self, worker_id: str, at: float) -> None:
        record = self.records[worker_id]
        self.records[worker_id] = replace(record, kv_usage=(record.kv_usage + 0.1) % 1.0, updated_at=at)
        self.version += 1
        self._changed.add(worker_id)

    async def poll(self, since: int, live: bool = True, limit: int = 5000) -> ChangePoll:
        changed, self._changed = frozenset(self._changed), set()
        return ChangePoll("epoch", self.version, changed, frozenset())

    async def read_fleet(self) -> list[WorkerRecord]:
        return [self.records[worker_id] for worker_id in sorted(self.records)]

    async def read_workers(self, worker_ids: Sequence[str]) -> dict[str, WorkerRecord | None]:
        return {worker_id: self.records.get(worker_id) for worker_id in worker_ids}

    async def read_busy(self) -> dict[str, int]:
        return {}


def fleet(pools: int, models: int) -> tuple[tuple[PoolSpec, ...], list[WorkerRecord]]:
    specs = tuple(PoolSpec(name=f"pool-{i}", model=f"model-{i % models}") for i in range(pools))
    records = [WorkerRecord(id=f"w{i:05d}", pool=specs[i % pools].name, model=specs[i % pools].model,
                            host=f"10.0.{i // 250}.{i % 250}", port=8000, kv_usage=0.5, updated_at=NOW)
               for i in range(WORKERS)]
    return specs, records


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    gc.collect()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def measure(pools: int, models: int, repeats: int) -> dict[str, float]:
    specs, records = fleet(pools, models)
    settings = ExtprocSettings()
    store = MemoryStore(records)
    clock = [NOW]
    watcher = FleetWatcher(store, specs, settings, InflightTracker(), Metrics(),  # type: ignore[arg-type]
                           clock=lambda: clock[0])
    loop = asyncio.new_event_loop()

    def refresh() -> None:
        loop.run_until_complete(watcher.refresh())

    refresh()  # the first, full read
    changed = iter(range(10**9))

    def one_change() -> None:
        clock[0] += 1e-4  # stays well inside the half bound
        store.change(f"w{next(changed) % WORKERS:05d}", clock[0])
        refresh()

    def half_bound_later() -> None:
        clock[0] += settings.stale_after_s / 2
        refresh()

    figures = {
        "full_build_ms": median_ms(lambda: build_snapshot(records, specs, NOW, settings.stale_after_s), repeats),
        "one_change_ms": median_ms(one_change, repeats),
        "unchanged_ms": median_ms(refresh, repeats),
        "half_bound_ms": median_ms(half_bound_later, max(3, repeats // 5)),
    }
    loop.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed refreshes per figure")
    args = parser.parse_args(argv)
    print(f"{WORKERS:,} workers; medians in ms (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    with host_quiet.measure() as quiet:
        rows = [{"pools": pools, "models": models, **measure(pools, models, args.repeats)}
                for pools, models in ((1, 1), (200, 25))]
    save_rows("snapshot_refresh", rows, COLUMNS, x_key="pools",
              panels=[Panel("refresh at 10,000 workers", ("full_build_ms", "one_change_ms", "unchanged_ms",
                                                           "half_bound_ms"), "ms", log_y=True)],
              parameters={"workers": WORKERS, "repeats": args.repeats, "load_average": os.getloadavg()[0]},
              host=quiet.stop())
    return 0


COLUMNS = [Column("pools", "pools", "{}"), Column("models", "models", "{}"),
           Column("full_build_ms", "full build ms", "{:.2f}"), Column("one_change_ms", "1 changed ms", "{:.3f}"),
           Column("unchanged_ms", "unchanged ms", "{:.3f}"), Column("half_bound_ms", "half bound on ms", "{:.3f}")]


if __name__ == "__main__":
    raise SystemExit(main())
