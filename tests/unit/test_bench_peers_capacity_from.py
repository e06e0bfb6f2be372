"""``bench peers --capacity-from``: an earlier run's capacities, so that a second run replays its traces."""

import argparse
import json
from pathlib import Path

import pytest

from bench import peers


def plan_for(tmp_path: Path, *extra: str) -> peers.Plan:
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    return peers.make_plan(parser.parse_args(["--out", str(tmp_path / "out"), *extra]))


def earlier_report(tmp_path: Path, **changes: object) -> Path:
    plan = plan_for(tmp_path, "--fleets", "homogeneous")
    report = {"seed": plan.seed, "time_scale": plan.time_scale,
              "window_model_s": plan.window.window_s * plan.time_scale,
              "drain_model_s": plan.window.drain_s * plan.time_scale,
              "plan": {"min_requests": plan.min_requests},
              "capacity": [{"fleet": "homogeneous", "scenario": "shared-docs", "rps": 15.0, "steps": []},
                           {"fleet": "homogeneous", "scenario": "mix", "rps": 22.9, "steps": []}]}
    report.update(changes)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_the_earlier_runs_capacities_replace_the_sweep(tmp_path: Path) -> None:
    path = earlier_report(tmp_path)
    plan = plan_for(tmp_path, "--fleets", "homogeneous", "--capacity-from", str(path))
    assert plan.reused["homogeneous/shared-docs"]["rps"] == 15.0
    assert plan.reused["homogeneous/mix"]["rps"] == 22.9
    assert "homogeneous/sessions" not in plan.reused  # not measured there: this run sweeps it


def test_a_run_with_other_traces_is_refused(tmp_path: Path) -> None:
    path = earlier_report(tmp_path, seed=99)
    with pytest.raises(SystemExit, match="seed 99 there, 13 here"):
        plan_for(tmp_path, "--capacity-from", str(path))
    with pytest.raises(SystemExit, match="time_scale"):
        plan_for(tmp_path, "--time-scale", "0.25", "--capacity-from", str(earlier_report(tmp_path)))


def test_longer_windows_take_the_same_capacities(tmp_path: Path) -> None:
    """More requests per cell than the earlier run: other traces than its, the same in every run that asks so."""
    plan = plan_for(tmp_path, "--min-requests", "400", "--capacity-from", str(earlier_report(tmp_path)))
    assert plan.reused["homogeneous/shared-docs"]["rps"] == 15.0


def test_routers_named_are_the_sweeps_routers_too(tmp_path: Path) -> None:
    """One router alone (poolgate, to compare its process counts) runs alone on the swept scenario as well."""
    plan = plan_for(tmp_path, "--routers", "poolgate", "--no-oracle")
    assert plan.sweep_routers == ("poolgate",)
    assert all(cell.routers == ("poolgate",) for fleet in plan.fleets for cell in peers.cells_of(plan, fleet))
