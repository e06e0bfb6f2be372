"""The lab is held to the real-process peers benchmark: on the cells measured both ways, every two routers that
the real runs tell apart order the same way in the lab.

The real figures (``tests/fixtures/peers-quick-real.json``) are ``bench peers --quick`` cells of ~100-200
requests per router, so a p99 moves from run to run by tens of percent: two routers count as told apart only
when every real run of the cell puts one at least ``APART`` times the other. The lab replays the same fleet,
scenario, arrivals and load with its own calibrated capacity; its figures are deterministic by seed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench import lab
from extproc.scheduling import RequestProfiler
from poolgate.kernel.config import SchedulingSettings

REAL = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "peers-quick-real.json").read_text())
APART = 1.25
LAB_ROUTER = {"poolgate": "poolgate", "least_request_weighted": "least_request", "sglang-router": "cache_aware",
              "vllm-router": "cache_aware", "oracle": "oracle"}
"""The real routers and the lab's implementation of each (both cache-aware routers run the same rule)."""
REQUESTS = 600
SEED = 7


def told_apart(runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(faster, slower) for each two routers that every real run orders the same way by at least ``APART``."""
    pairs = []
    for a, b in itertools.permutations(runs[0]["p99_s"], 2):
        if LAB_ROUTER[a] != LAB_ROUTER[b] and all(run["p99_s"][a] * APART <= run["p99_s"][b] for run in runs):
            pairs.append((a, b))
    return pairs


def test_the_real_runs_tell_some_routers_apart() -> None:
    """Guards the fixture: a cell whose runs tell no router apart would hold the lab to nothing."""
    for cell in REAL["cells"]:
        assert told_apart(cell["runs"]), cell


@pytest.mark.parametrize("cell", REAL["cells"], ids=lambda cell: f"{cell['fleet']}/{cell['scenario']}")
def test_the_lab_orders_routers_as_the_real_benchmark_does(cell: dict[str, Any]) -> None:
    pairs = told_apart(cell["runs"])
    settings = SchedulingSettings()
    names = sorted({LAB_ROUTER[router] for pair in pairs for router in pair})
    spec = lab.CellSpec(cell["fleet"], cell["scenario"], cell["arrivals"] == "bursty", cell["level"], REQUESTS,
                        SEED)
    capacities = json.loads(lab.CAPACITY_FILE.read_text())
    rows = lab.run_cell(spec, [(name, lab.router_factory(name, SEED, settings)) for name in names],
                        capacities[f"{cell['fleet']}/{cell['scenario']}/{SEED}"], RequestProfiler(settings))
    p99 = {row["router"]: row["ttft_p99_s"] for row in rows}
    print(f"{spec.name}: lab p99 {p99}; real runs {[run['p99_s'] for run in cell['runs']]}")
    for faster, slower in pairs:
        assert p99[LAB_ROUTER[faster]] < p99[LAB_ROUTER[slower]], (
            f"real runs put {faster} ahead of {slower}; the lab does not ({p99})")
