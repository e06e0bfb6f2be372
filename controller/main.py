"""``poolgate controller``: wires the registry API, the fleet watcher, the xDS server and local workers.

The fleet watcher is the only bridge from Redis to Envoy: it reads the registry on every change
notification and at least every ``poll_s``, and hands the workers to the xDS server, which pushes new
endpoints only when their content changed. Expired workers vanish from the registry and so from Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import tempfile
from pathlib import Path

import redis.asyncio as aioredis
import uvloop
from aiohttp import web

from controller.agent.agent import run_agent
from controller.local_backend import LocalProcessBackend
from controller.registry_api import RegistryApi
from controller.xds.server import XdsServer
from poolgate.config import Config, ConfigError, load_config
from poolgate.fleet import FleetKeys, read_fleet

log = logging.getLogger("poolgate.controller")


async def watch_fleet(redis: aioredis.Redis, keys: FleetKeys, xds: XdsServer, poll_s: float = 0.25) -> None:
    """Push the registry to the xDS server on every change notification and every ``poll_s``."""
    pubsub = redis.pubsub()
    subscribed = False
    redis_down = False
    while True:
        try:
            if not subscribed:
                await pubsub.subscribe(keys.events)
                subscribed = True
            workers = await read_fleet(redis, keys)
            xds.update(workers)
            if redis_down:
                log.info("redis is back; registry watch resumed")
                redis_down = False
            # Wait for a change notification, or at most poll_s (expiries publish nothing).
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
            while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0):
                pass
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as exc:
            if not redis_down:
                log.warning("redis unreachable (%s); Envoy keeps the last endpoints", exc)
                redis_down = True
            subscribed = False
            with contextlib.suppress(Exception):
                await pubsub.reset()
            pubsub = redis.pubsub()
            await asyncio.sleep(poll_s)


async def run_controller(config: Config, redis_url: str, *, host: str, xds_port: int, http_port: int,
                         token: str, log_dir: Path, start_workers: bool = True) -> None:
    redis = aioredis.from_url(redis_url)
    keys = FleetKeys(config.key_prefix)
    xds = XdsServer(config.pools)
    bound_xds = await xds.start(host, xds_port)
    api = web.AppRunner(RegistryApi(config, redis, keys, token).app(), access_log=None)
    await api.setup()
    site = web.TCPSite(api, host, http_port)
    await site.start()
    http_port = api.addresses[0][1]
    backend = LocalProcessBackend(config, redis, keys, log_dir)
    if start_workers:
        await backend.start_all()
    print(f"controller ready: api http://{host}:{http_port} xds {host}:{bound_xds} "
          f"workers {len(config.workers) if start_workers else 0}", flush=True)
    watcher = asyncio.create_task(watch_fleet(redis, keys, xds))
    # The agent reads the local workers' /metrics and GPUs into Redis (one per node; here the node is us).
    agent = asyncio.create_task(run_agent(config, redis, keys))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("stopping: workers, API, xDS")
        for task in (watcher, agent):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await backend.stop_all()
        await api.cleanup()
        await xds.stop()
        await redis.aclose()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="poolgate YAML config")
    parser.add_argument("--redis-url", help="overrides the config's redis_url")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--xds-port", type=int, help="ADS port (default: config ports.xds)")
    parser.add_argument("--http-port", type=int, help="registry API port (default: config ports.controller_http)")
    parser.add_argument("--log-dir", help="where worker logs go (default: a temporary directory)")
    parser.add_argument("--no-workers", action="store_true", help="do not start the config's workers")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    redis_url = args.redis_url or config.redis_url
    token = config.controller.resolved_token()
    if not redis_url:
        print("controller: no Redis URL (give --redis-url or redis_url in the config)", file=sys.stderr)
        return 2
    if not token:
        print(f"controller: no token (set {config.controller.token_env} or controller.token)", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="poolgate-workers-"))
    uvloop.run(run_controller(
        config, redis_url, host=args.host,
        xds_port=args.xds_port if args.xds_port is not None else config.ports.xds,
        http_port=args.http_port if args.http_port is not None else config.ports.controller_http,
        token=token, log_dir=log_dir, start_workers=not args.no_workers,
    ))
    return 0
