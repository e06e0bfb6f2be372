"""``poolgate status``: the fleet as Redis holds it, as a table."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from poolgate.fleet import FleetKeys, WorkerRecord, read_fleet, read_inflight

COLUMNS = ("worker", "model", "pool", "state", "address", "in-flight", "kv", "running", "waiting", "age")


def format_table(workers: Sequence[WorkerRecord], inflight: dict[str, int], now: float) -> str:
    rows = [COLUMNS]
    for w in workers:
        rows.append((w.id, w.model, w.pool, str(w.state), w.address, str(inflight.get(w.id, 0)),
                     f"{w.kv_usage:.0%}", str(w.running), str(w.waiting), f"{max(0.0, now - w.updated_at):.1f}s"))
    if len(rows) == 1:
        return "no workers registered"
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


async def fleet_table(redis_url: str, key_prefix: str) -> str:
    redis = aioredis.from_url(redis_url)
    try:
        keys = FleetKeys(key_prefix)
        workers = await read_fleet(redis, keys)
        inflight = await read_inflight(redis, keys, [w.id for w in workers])
        return format_table(workers, inflight, time.time())
    finally:
        await redis.aclose()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--key-prefix", default="poolgate")


def main(args: argparse.Namespace) -> int:
    try:
        print(asyncio.run(fleet_table(args.redis_url, args.key_prefix)))
    except (aioredis.ConnectionError, OSError) as exc:
        print(f"cannot reach Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 1
    return 0
