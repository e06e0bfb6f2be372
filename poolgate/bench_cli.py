"""``poolgate bench NAME [ARGS…]``: run ``bench/NAME.py`` of a source checkout with its own arguments.

The benchmarks live next to the packages, not inside them (they are tools, not product), so this only
works from a checkout (or an editable install of one); ``poolgate bench scheduling --help`` shows a
benchmark's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
NOT_BENCHMARKS = {"__init__", "harness", "report"}


def available() -> list[str]:
    """Benchmark modules of the checkout that have a ``main(argv)``."""
    if not BENCH_DIR.is_dir():
        return []
    return sorted(path.stem for path in BENCH_DIR.glob("*.py")
                  if path.stem not in NOT_BENCHMARKS and "def main(" in path.read_text())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="benchmark to run: " + (", ".join(available()) or "none found"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")


def main(args: argparse.Namespace) -> int:
    names = available()
    if args.name not in names:
        where = f"in {BENCH_DIR}" if BENCH_DIR.is_dir() else "(bench/ ships with the source checkout only)"
        print(f"poolgate bench: no benchmark {args.name!r} {where}; known: {', '.join(names) or 'none'}",
              file=sys.stderr)
        return 2
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(f"bench.{args.name}")
    return int(module.main(args.args) or 0)
