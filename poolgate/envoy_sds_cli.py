"""``poolgate envoy-sds --config FILE``: write the SDS files through which Envoy reads its certificate files
(``tls.envoy``, ``tls.workers``) into ``tls.envoy_sds_dir``, for an Envoy that ``poolgate up`` does not start.

Run it on Envoy's machine before Envoy starts, and again after changing those sections of the config (a
running Envoy reloads a rewritten SDS file). Rotating the certificates themselves needs no run of it.
"""

from __future__ import annotations

import argparse
import sys

from poolgate.kernel.config import ConfigError, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the poolgate configuration file")


def main(args: argparse.Namespace) -> int:
    from controller.xds.envoy_tls import write_sds_files

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    written = write_sds_files(config.tls)
    if not written:
        print("no tls.envoy or tls.workers in the config: Envoy needs no SDS files", file=sys.stderr)
        return 0
    for path in written:
        print(path)
    return 0
