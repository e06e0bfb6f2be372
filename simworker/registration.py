"""A simulated worker that registers itself with the registry API and heartbeats it, as an external worker does
(``poolgate simworker --register-with URL --pool NAME``), at the interval each of the registry's answers names
(``poolgate.kernel.heartbeat_client``). Without the flag the controller that started the worker registers it."""

from __future__ import annotations

import argparse
import asyncio
import os

from poolgate.kernel.heartbeat_client import WorkerHeartbeats
from simworker.worker import SimWorker

TOKEN_ENV = "POOLGATE_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("self-registration (an external worker's heartbeats)")
    group.add_argument("--register-with", metavar="URL",
                       help="register each worker with the registry API at URL and heartbeat it at the interval "
                            "the registry names (default: do not; the controller that started it registers it)")
    group.add_argument("--pool", help="the pool to register in (with --register-with)")
    group.add_argument("--registry-token", default=os.environ.get(TOKEN_ENV) or None,
                       help=f"the controller token (default: ${TOKEN_ENV})")


def check(args: argparse.Namespace) -> None:
    """ValueError for a registration the flags cannot make."""
    if args.register_with and not (args.pool and args.registry_token):
        raise ValueError(f"--register-with needs --pool and a token (--registry-token or ${TOKEN_ENV})")


async def keep_registered(args: argparse.Namespace, worker: SimWorker, stop: asyncio.Event) -> None:
    """Once ``worker`` listens, register it and heartbeat until ``stop`` (nothing without ``--register-with``)."""
    if not args.register_with:
        return
    if not await _first(worker.listening, stop):
        return
    spec = worker.spec
    registration = {"id": spec.worker_id, "pool": args.pool, "host": spec.host, "port": spec.port,
                    "model": spec.model_name}
    quiet = asyncio.Event()  # a crashed engine stops beating, so its registration runs out as a dead one's does

    async def until_stopped_or_crashed() -> None:
        await _first(stop, worker.crashed)
        quiet.set()

    watcher = asyncio.create_task(until_stopped_or_crashed())
    try:
        await WorkerHeartbeats(args.register_with, args.registry_token, registration).run(quiet)
    finally:
        watcher.cancel()


async def _first(wanted: asyncio.Event, other: asyncio.Event) -> bool:
    """Wait until either event is set; True when ``wanted`` is."""
    waits = {asyncio.create_task(wanted.wait()), asyncio.create_task(other.wait())}
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return wanted.is_set()
