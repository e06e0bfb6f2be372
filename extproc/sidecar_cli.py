"""``poolgate pd-sidecar``: run the prefill/decode sidecar that Envoy sends split requests to."""

from __future__ import annotations

import argparse
import asyncio
import sys

from poolgate.kernel.config import ConfigError, load_config
from poolgate.kernel.logging_setup import add_log_format_argument, configure_logging
from poolgate.kernel.shutdown import on_stop_signal

STOP_DEADLINE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="poolgate YAML configuration file (its disaggregation section)")
    parser.add_argument("--host", default=None, help="address to listen on (default: disaggregation.sidecar_host)")
    parser.add_argument("--port", type=int, default=None, help="port (default: disaggregation.sidecar_port)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add_log_format_argument(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        settings = load_config(args.config).disaggregation
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    host = args.host or settings.sidecar_host
    port = settings.sidecar_port if args.port is None else args.port
    if not port:
        print("poolgate pd-sidecar: set disaggregation.sidecar_port or --port", file=sys.stderr)
        return 2

    import uvloop

    from extproc.sidecar import serve

    async def run() -> None:
        stop = asyncio.Event()
        on_stop_signal(asyncio.get_running_loop(), stop.set, STOP_DEADLINE_S)
        print(f"poolgate pd-sidecar listening on {host}:{port}", flush=True)
        await serve(host, port, settings.step_timeout_s, stop)

    try:
        uvloop.run(run())
    except OSError as error:
        print(f"poolgate pd-sidecar: cannot listen: {error}", file=sys.stderr)
        return 2
    return 0
