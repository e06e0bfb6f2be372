"""``poolgate drain WORKER``: take a worker out of rotation gracefully, then stop it.

The worker turns Draining (Envoy DRAINING, extproc stops choosing it), its requests and streams finish,
and the controller stops it once nothing is in flight or the grace period ends. ``--wait`` returns then.
"""

from __future__ import annotations

import argparse

from poolgate.controller_client import add_common_arguments, call, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", help="worker id (see `poolgate status`)")
    parser.add_argument("--wait", action="store_true", help="return when the drain is over")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long --wait may take")
    add_common_arguments(parser)


async def _drain(args: argparse.Namespace) -> int:
    path = f"/v1/workers/{args.worker}/drain" + ("?wait=1" if args.wait else "")
    status, body = await call(args, path, timeout_s=args.timeout_s if args.wait else 30.0)
    if status in (200, 202):
        print(f"{args.worker}: {body.get('state')}" + (f" ({body['reason']})" if body.get("reason") else ""))
        return 0
    print(f"poolgate drain: {body.get('error', {}).get('message', body)}")
    return 1


def main(args: argparse.Namespace) -> int:
    return run(_drain(args))
