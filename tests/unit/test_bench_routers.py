"""The peers benchmark's fairness plumbing: capacity weights, the weighted Envoy baseline, the peers'
command lines (offline, scaled intervals), control loops scaled with the time scale, the seeded router
order and the size of the full run. Nothing here installs a peer or needs the network."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest
import yaml

from bench import peers
from bench.baseline_envoy import baseline_bootstrap, baseline_cluster
from bench.peer_install import PeerVenv
from bench.routers import OFFLINE_ENV, capacity_weights, peer_command
from bench.sched_fleet import LAYOUTS, fleet_config, plan_workers
from poolgate.kernel.config import load_config


def test_capacity_weights_follow_measured_tokens_per_pool() -> None:
    tokens = {"h100": 9000, "l4-a": 1000, "l4-b": 0, "code-1": 300, "code-2": 600}
    weights = capacity_weights(tokens, {"chat": ["h100", "l4-a", "l4-b"], "code": ["code-1", "code-2"]})
    assert weights == {"h100": 100, "l4-a": 11, "l4-b": 1, "code-1": 50, "code-2": 100}


def test_only_the_weighted_baseline_carries_weights() -> None:
    bootstrap = baseline_bootstrap({"chat": [("127.0.0.1", 9001, 100), ("127.0.0.1", 9002, 11)]},
                                   listen_port=1, admin_port=2)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    weighted = clusters[baseline_cluster("chat", "least_request_weighted")]
    assert weighted["lb_policy"] == "LEAST_REQUEST"
    endpoints = weighted["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["load_balancing_weight"] for e in endpoints] == [100, 11]
    plain = clusters[baseline_cluster("chat", "least_request")]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert all("load_balancing_weight" not in e for e in plain)


@pytest.mark.parametrize("project", ["vllm-router", "sglang-router"])
def test_peer_command_lines_stay_local_and_scale_their_intervals(project: str) -> None:
    venv = PeerVenv(Path("/venv"), {})
    command = peer_command(venv, project, "cache_aware", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 5000,
                           5001, time_scale=0.5)
    assert command[0] == ("/venv/bin/vllm-router" if project == "vllm-router" else "/venv/bin/python")
    flags = dict(itertools.pairwise(command))
    assert flags["--host"] == "127.0.0.1" and flags["--prometheus-host"] == "127.0.0.1"
    assert flags["--port"] == "5000" and flags["--prometheus-port"] == "5001" and flags["--policy"] == "cache_aware"
    assert flags["--eviction-interval-secs"] == ("240" if project == "vllm-router" else "120")
    assert command[command.index("--worker-urls") + 1:command.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert OFFLINE_ENV["HF_HUB_OFFLINE"] == "1" and OFFLINE_ENV["TRANSFORMERS_OFFLINE"] == "1"


def test_control_loops_scale_with_the_time_scale_and_the_config_loads(tmp_path: Path) -> None:
    workers = plan_workers(LAYOUTS["homogeneous"])
    assert {w.preset for w in workers} == {"h100-80gb"} and len(workers) == 4
    path = tmp_path / "poolgate.yaml"
    path.write_text(yaml.safe_dump(fleet_config(workers, 0.5)))
    config = load_config(path)
    assert config.agent.scrape_interval_s == pytest.approx(0.5)
    assert config.extproc.snapshot_refresh_s == pytest.approx(0.2)
    assert config.scheduling.max_wait_s == pytest.approx(10.0)
    assert config.scheduling.default_prefill_tokens_per_s == pytest.approx(4000.0)
    assert all(list(w.extra_args[:2]) == ["--time-scale", "0.5"] for w in config.workers)


def full_plan() -> peers.Plan:
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    return peers.make_plan(parser.parse_args(["--out", "x"]))


def test_router_order_is_shuffled_by_the_seed_and_differs_between_cells() -> None:
    routers = list(peers.MAIN_ROUTERS)
    assert peers.router_order(routers, 3, "a") == peers.router_order(routers, 3, "a")
    assert sorted(peers.router_order(routers, 3, "a")) == sorted(routers)
    assert len({tuple(peers.router_order(routers, seed, "a")) for seed in range(10)}) > 1
    assert len({tuple(peers.router_order(routers, 3, cell)) for cell in "abcdefgh"}) > 1


def test_the_full_run_covers_every_scenario_and_fleet_and_sweeps_one() -> None:
    plan = full_plan()
    cells = [cell for fleet in plan.fleets for cell in peers.cells_of(plan, fleet)]
    assert {(c.fleet, c.scenario.name) for c in cells} == {
        (fleet, scenario) for fleet in LAYOUTS for scenario in ("mix", "sessions", "shared-docs")}
    assert {(c.fleet, c.scenario.name) for c in cells if c.arrivals == "bursty"} == {
        ("heterogeneous", scenario) for scenario in ("mix", "sessions", "shared-docs")}
    swept = [c for c in cells if len(c.levels) > 1]
    assert len(swept) == 1 and swept[0].levels == (0.5, 0.85, 1.0) and len(swept[0].routers) == 8
    for cell in cells:
        assert {"poolgate", "least_request_weighted", "vllm-router:cache_aware",
                "sglang-router:cache_aware"} <= set(cell.routers)
        assert 0.85 in cell.levels
        assert ("oracle" in cell.routers) == (cell.scenario.name in ("shared-docs", "sessions"))


def test_quick_runs_one_shared_prefix_scenario_with_a_peer_of_each_project() -> None:
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    plan = peers.make_plan(parser.parse_args(["--out", "x", "--quick"]))
    cells = [cell for fleet in plan.fleets for cell in peers.cells_of(plan, fleet)]
    assert len(cells) == 1 and cells[0].scenario.name == "shared-docs" and cells[0].levels == (0.85,)
    projects = {router.split(":")[0] for router in cells[0].routers}
    assert {"poolgate", "vllm-router", "sglang-router", "oracle"} <= projects
