"""``poolgate status``: the fleet as Redis holds it, as a table; ``--watch`` redraws it until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.redis_client import parse_redis_url
from poolgate.kernel.store import FleetStore, connect

COLUMNS = ("worker", "model", "pool", "state", "address", "in-flight", "kv", "running", "waiting", "prefix hits",
           "age")
CLEAR_SCREEN = "\x1b[H\x1b[2J"
SERVING = (WorkerState.READY, WorkerState.BUSY)


def format_table(workers: Sequence[WorkerRecord], inflight: dict[str, int], now: float) -> str:
    rows = [COLUMNS]
    for w in workers:
        rows.append((w.id, w.model, w.pool, _state(w), w.address, str(inflight.get(w.id, 0)),
                     f"{w.kv_usage:.0%}", str(w.running), _waiting(w), _hit_rate(w),
                     f"{max(0.0, now - w.updated_at):.1f}s"))
    if len(rows) == 1:
        return "no workers registered"
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _state(worker: WorkerRecord) -> str:
    """The state, and vLLM's sleep level when the engine sleeps (it then gets no requests)."""
    return f"{worker.state} (asleep, level {worker.sleep_level})" if worker.sleep_level else str(worker.state)


def _waiting(worker: WorkerRecord) -> str:
    """The engine's queue, with the part held back by LoRA budget or KV transfer rather than by capacity."""
    return f"{worker.waiting} ({worker.waiting_deferred} deferred)" if worker.waiting_deferred else str(worker.waiting)


def _hit_rate(worker: WorkerRecord) -> str:
    return "-" if worker.prefix_cache_hit_rate < 0 else f"{worker.prefix_cache_hit_rate:.0%}"


def format_pools(workers: Sequence[WorkerRecord], inflight: dict[str, int]) -> str:
    """One line per pool: what serves, what waits, how full the KV caches are (the watch view's summary)."""
    lines = []
    for pool in sorted({w.pool for w in workers}):
        members = [w for w in workers if w.pool == pool]
        serving = [w for w in members if w.state in SERVING and not w.sleep_level]
        kv = sum(w.kv_usage for w in serving) / len(serving) if serving else 0.0
        lines.append(f"pool {pool}: {len(serving)}/{len(members)} serving, "
                     f"in-flight {sum(inflight.get(w.id, 0) for w in members)}, "
                     f"running {sum(w.running for w in members)}, waiting {sum(w.waiting for w in members)}, "
                     f"mean kv {kv:.0%}")
    return "\n".join(lines)


async def fleet_view(store: FleetStore, *, summary: bool = False) -> str:
    workers = await store.read_fleet()
    inflight = await store.read_inflight([w.id for w in workers])
    table = format_table(workers, inflight, time.time())
    return f"{format_pools(workers, inflight)}\n\n{table}" if summary and workers else table


async def fleet_table(redis_url: str, key_prefix: str) -> str:
    redis = connect(redis_url, max_connections=None)
    try:
        return await fleet_view(FleetStore(redis, key_prefix))
    finally:
        await redis.aclose()


async def watch(read: Callable[[], Awaitable[str]], interval_s: float, write: Callable[[str], None],
                stop: asyncio.Event, *, clear: bool, source: str) -> int:
    """Redraw until ``stop`` is set; returns the number of frames. A Redis outage shows in the frame and
    the next refresh retries: a watch is left running on a screen, it should outlive a restart."""
    frames = 0
    while not stop.is_set():
        try:
            body = await read()
        except REDIS_ERRORS as exc:
            body = f"cannot reach Redis at {source}: {exc} (retrying)"
        stamp = time.strftime("%H:%M:%S")
        write(f"{CLEAR_SCREEN if clear else ''}poolgate fleet at {stamp}, every {interval_s:g} s "
              f"(Ctrl-C to stop)\n\n{body}\n")
        frames += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    return frames


async def _watch_main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    redis = connect(args.redis_url, max_connections=None, socket_timeout=2.0, socket_connect_timeout=2.0)
    store = FleetStore(redis, args.key_prefix)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        await watch(lambda: fleet_view(store, summary=True), args.interval, write, stop,
                    clear=sys.stdout.isatty(), source=redact_url(args.redis_url))
    finally:
        await redis.aclose()


def _interval(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.1 and 3600 seconds")
    return value


def redis_url_argument(text: str) -> str:
    """An argparse type: a Redis URL in one of the forms ``poolgate.kernel.redis_client`` accepts."""
    try:
        parse_redis_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", type=redis_url_argument, default="redis://127.0.0.1:6379/0",
                        help="redis://, rediss://, unix://, redis+sentinel://HOST:PORT[,…]/SERVICE or "
                             "redis+cluster://HOST:PORT[,…]")
    parser.add_argument("--key-prefix", default="poolgate")
    parser.add_argument("--watch", action="store_true", help="redraw the fleet table until Ctrl-C")
    parser.add_argument("--interval", type=_interval, default=1.0, help="seconds between redraws (default 1)")


def main(args: argparse.Namespace) -> int:
    if args.watch:
        asyncio.run(_watch_main(args))
        return 0
    try:
        print(asyncio.run(fleet_table(args.redis_url, args.key_prefix)))
    except REDIS_ERRORS as exc:
        print(f"cannot reach Redis at {redact_url(args.redis_url)}: {exc}", file=sys.stderr)
        return 1
    return 0
