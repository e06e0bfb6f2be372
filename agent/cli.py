"""``poolgate agent``: scrape this node's workers and GPUs into Redis until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from agent.podresources import POD_RESOURCES_SOCKET
from poolgate.kernel.config import ConfigError, load_process_config
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.shutdown import on_stop_signal

NODE_ENV = "POOLGATE_NODE_NAME"
"""Set from the Downward API (``spec.nodeName``) in the agent's DaemonSet."""
STOP_DEADLINE_S = 5.0
"""The agent holds nothing to hand over: stopping is cancelling its scrape loop."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="poolgate YAML configuration file")
    parser.add_argument("--redis-url", default=None,
                        help="Redis URL (default: redis_url from the configuration file)")
    parser.add_argument("--workers", nargs="+", metavar="ID", default=None,
                        help="scrape only these worker ids, wherever they run (overrides --node)")
    parser.add_argument("--node", metavar="NAME", default=os.environ.get(NODE_ENV) or None,
                        help="this node's name: scrape the workers registered on it, at any address (on "
                             f"Kubernetes the pod's spec.nodeName; default: ${NODE_ENV}). Workers registered "
                             "without a node, and all workers when no name is given, are matched by an address "
                             "of this machine")
    parser.add_argument("--pod-resources-socket", metavar="PATH", default=POD_RESOURCES_SOCKET,
                        help="the kubelet's PodResources socket; with --node, where the agent learns which GPUs "
                             "each worker pod holds (default: %(default)s; skipped when it does not exist)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, redis_url = load_process_config(args.config, args.redis_url, "agent")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

    import redis.asyncio as aioredis
    import uvloop

    from agent.agent import Agent, run_agent
    from poolgate.kernel.heap import freeze_startup_objects
    from poolgate.kernel.store import FleetStore, connect

    def ready(agent: Agent) -> None:
        freeze_startup_objects()
        if args.workers:
            scope = " ".join(args.workers)
        elif args.node:
            scope = f"workers on node {args.node}"
        else:
            scope = "workers on this host"
        print(f"poolgate agent ready: scraping {scope} every {config.agent.scrape_interval_s:g} s "
              f"(GPUs: {config.agent.gpu_source}; redis {redact_url(redis_url)})", flush=True)

    async def run() -> None:
        redis = connect(redis_url, max_connections=None)
        stop = asyncio.Event()
        on_stop_signal(asyncio.get_running_loop(), stop.set, STOP_DEADLINE_S)
        try:
            await redis.ping()  # fail fast: a wrong URL should not look like an idle agent
            await run_agent(config, FleetStore(redis, config.key_prefix), stop, worker_ids=args.workers,
                            node=args.node, pod_resources_socket=args.pod_resources_socket, ready=ready)
        finally:
            await redis.aclose()

    try:
        uvloop.run(run())
    except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
        print(f"agent: cannot reach Redis at {redact_url(redis_url)}: {exc}", file=sys.stderr)
        return 1
    return 0
