"""The ``poolgate`` command: one entry point, one subcommand per process or tool.

Each subcommand's module owns its arguments (``add_arguments``) and its ``main``; imports are lazy so
``poolgate status`` does not pay for grpc or Envoy protos.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("poolgate.up", "start the whole stack locally (Redis, controller, extproc, Envoy, workers)"),
    "controller": ("controller.main", "run the controller (registry API, xDS, local workers)"),
    "extproc": ("extproc.cli", "run the Envoy external processor"),
    "pd-sidecar": ("extproc.sidecar_cli", "run the prefill/decode sidecar (two steps for one split request)"),
    "simworker": ("simworker.cli", "run simulated vLLM workers"),
    "agent": ("agent.cli", "scrape workers' metrics and GPUs into Redis"),
    "status": ("poolgate.status", "show the fleet from Redis"),
    "config": ("poolgate.config_cli", "check a configuration file"),
    "tenant": ("poolgate.tenant_cli", "make a tenant API key (printed once; the config keeps its hash)"),
    "bench": ("poolgate.bench_cli", "run a benchmark under bench/"),
    "scale": ("poolgate.scale_cli", "set a pool's number of workers (through the controller)"),
    "drain": ("poolgate.drain_cli", "drain a worker: no new requests, finish in-flight ones, then stop it"),
    "envoy-sds": ("poolgate.envoy_sds_cli", "write the SDS files that name Envoy's certificate files (tls section)"),
}


GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
"""Read by gRPC when it is imported. poolgate's processes fork only to exec a child (the controller its
workers, ``up`` the stack), which needs none of gRPC's fork handlers; with them on, a fork while a TLS
handshake waits for its Python certificate callback (``poolgate.kernel.tls``) stalled the controller 62 s
per worker started (measured)."""


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")  # before any subcommand imports grpc
    parser = argparse.ArgumentParser(prog="poolgate", description="Resource-aware routing for LLM fleets")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text)
        if name in (sys.argv[1:2] if argv is None else argv[:1]):
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            modules[name] = module
    args = parser.parse_args(argv)
    module = modules.get(args.command) or importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
