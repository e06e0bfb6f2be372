"""The autoscale benchmark's model: both fleets see the same trace, the autoscaler follows the day."""

from __future__ import annotations

import json
from pathlib import Path

from bench.autoscale import QUICK, Scenario, simulate


def test_static_fleet_worker_seconds_and_slo() -> None:
    scenario = Scenario(period_s=600.0, peak_rps=10.0, startup_s=5.0)
    small, large = simulate(scenario, 1), simulate(scenario, 6)
    assert large.worker_seconds == 6 * 600.0 and small.worker_seconds == 600.0
    assert small.slo_attainment < large.slo_attainment == 1.0


def test_autoscaled_fleet_follows_the_diurnal_trace() -> None:
    result = simulate(Scenario(period_s=900.0, peak_rps=20.0, startup_s=5.0), None)
    assert result.workers_min < result.workers_max and result.decisions.get("up", 0) >= 2
    assert result.decisions.get("down", 0) >= 1
    assert result.slo_attainment > 0.99


def test_quick_run_writes_its_report(tmp_path: Path) -> None:
    from bench.autoscale import main

    assert main(["--out", str(tmp_path), "--quick"]) == 0
    summary = json.loads((tmp_path / "autoscale.json").read_text())
    assert summary["kind"] == "model" and summary["scenario"]["period_s"] == QUICK.period_s
    assert 0 < summary["worker_seconds_ratio"] < 1
    assert (tmp_path / "autoscale.md").exists() and (tmp_path / "autoscale_timeline.csv").exists()
