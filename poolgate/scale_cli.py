"""``poolgate scale POOL N``: set a pool's worker count now (within its autoscale bounds).

New workers come from the pool's template; surplus workers leave through a drain. With the autoscaler
on, it may move the pool again later by its own rules.
"""

from __future__ import annotations

import argparse

from poolgate.controller_client import add_common_arguments, call, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", help="pool name")
    parser.add_argument("workers", type=int, help="target number of workers")
    add_common_arguments(parser)


async def _scale(args: argparse.Namespace) -> int:
    status, body = await call(args, f"/v1/pools/{args.pool}/scale", {"workers": args.workers})
    if status == 200:
        started = ", ".join(body["started"]) or "none"
        draining = ", ".join(body["draining"]) or "none"
        print(f"pool {body['pool']}: {body['before']} -> {body['target']} workers; started {started}; "
              f"draining {draining}")
        return 0
    print(f"poolgate scale: {body.get('error', {}).get('message', body)}")
    return 1


def main(args: argparse.Namespace) -> int:
    return run(_scale(args))
