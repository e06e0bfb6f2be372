"""The pick micro-benchmark still runs (a few picks per scenario, no timing claims here)."""

from __future__ import annotations

import pytest

from bench import pick_microbench


@pytest.mark.parametrize("scenario", pick_microbench.SCENARIOS, ids=lambda s: s.name)
def test_every_scenario_places_requests(scenario: pick_microbench.Scenario) -> None:
    row = pick_microbench.run(scenario, picks=200)
    assert row["picks"] == 200 and float(row["placed_share"]) > 0.5
    assert 0 < float(row["p50_us"]) <= float(row["p99_us"])
