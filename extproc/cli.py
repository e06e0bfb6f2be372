"""``poolgate extproc``: run the Envoy external processor."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from extproc.scheduling import PLUGINS
from poolgate.kernel.config import ConfigError, load_process_config
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.logging_setup import add_log_format_argument, configure_logging
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.shutdown import on_stop_signal

STOP_DEADLINE_S = 12.0
"""Streams get 5 s to finish, the last in-flight counts 1 s to reach Redis; Kubernetes waits 15 s."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="poolgate YAML configuration file")
    parser.add_argument("--redis-url", default=None,
                        help="Redis URL (default: redis_url from the configuration file)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (default: ports.extproc from the configuration; 0 = any free port)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (default: observability.extproc_metrics_port "
                             "from the configuration, else off)")
    parser.add_argument("--siblings", default=None,
                        help="comma-separated gRPC ports of the extproc processes started with this one on this "
                             "host, its own among them: they tell each other every placement at once "
                             "(poolgate up sets it)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add_log_format_argument(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        config, redis_url = load_process_config(args.config, args.redis_url, "extproc")
        PLUGINS.check(config.scheduling)  # the scheduling plugins' names and own settings, before anything listens
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    port = config.ports.extproc if args.port is None else args.port
    metrics_port = config.observability.extproc_metrics_port if args.metrics_port is None else args.metrics_port

    def listening(bound: int) -> None:
        freeze_startup_objects()
        print(f"poolgate extproc listening on {args.host}:{bound} (redis {redact_url(redis_url)})", flush=True)

    import uvloop

    from extproc.server import serve
    from extproc.siblings import sibling_ports

    async def run() -> None:
        task = asyncio.create_task(serve(config, redis_url, args.host, port, metrics_port, listening,
                                         config_path=args.config, sibling_ports=sibling_ports(args.siblings)))
        on_stop_signal(asyncio.get_running_loop(), task.cancel, STOP_DEADLINE_S)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        uvloop.run(run())
    except ConfigError as exc:  # e.g. scheduling.tokenizer_path, checked before listening
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 1
    return 0
