"""``poolgate config check FILE``: validate a configuration and print every problem with its field path.

The scheduling plugins' names and their own settings are checked against extproc's plugin registry, which the
configuration loader (below every program) cannot import.
"""

from __future__ import annotations

import argparse
import sys

from extproc.scheduling import PLUGINS
from poolgate.kernel.config import ConfigError, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="validate FILE")
    check.add_argument("file")


def main(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
        PLUGINS.check(config.scheduling)  # plugin names and settings: extproc's registry knows them
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{args.file}: OK ({len(config.pools)} pools, {len(config.workers)} workers)")
    return 0
