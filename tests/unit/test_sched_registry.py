"""The plugin registry: every plugin under its snake_case name, the configuration checked against it, and a
new scorer added with one class and one registry entry (a toy one, here in the test)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from extproc.request import RequestFacts
from extproc.scheduling import PLUGINS, Decision, PickContext, PickRequest
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import SCORER_NAMES, ConfigError, PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord

NOW = 1_000.0
POOLS = (PoolSpec(name="chat", model="llama"),)
EVERY_FILTER_ON = SchedulingSettings(max_inflight_per_worker=8, gpu_memory_min_free_mib=1.0, max_prefill_backlog_s=0.5)


class MostRunning:
    """Toy scorer: prefer the busiest worker, score(w) = running_w / max(running) (1 for all when all idle)."""

    name = "most_running"

    def score(self, request: PickRequest, candidates: Sequence[WorkerRecord],
              context: PickContext) -> Sequence[float]:
        busiest = max(w.running for w in candidates)
        return [w.running / busiest if busiest else 1.0 for w in candidates]


def worker(worker_id: str, running: int) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="10.0.0.1", port=8000 + running,
                        updated_at=NOW, running=running, kv_capacity_tokens=100_000)


def pick_among(settings: SchedulingSettings, registry: object = PLUGINS, seed: int = 0) -> str:
    workers = [worker("idle", 0), worker("busy", 5), worker("mid", 2)]
    request = PickRequest(RequestFacts("/v1/chat/completions", "POST", "llama"), 10, 10, 10, "short_chat")
    scheduler = registry.scheduler(settings, random.Random(seed))  # type: ignore[attr-defined]
    outcome = scheduler.pick(request, PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}))
    assert isinstance(outcome, Decision)
    return outcome.worker_id


def test_every_plugin_is_registered_under_its_own_snake_case_name() -> None:
    built = {f.name for f in PLUGINS.build_filters(EVERY_FILTER_ON)}
    assert built == set(PLUGINS.filters)
    assert set(PLUGINS.build_scorers(EVERY_FILTER_ON)) == set(PLUGINS.scorers)
    assert [PLUGINS.pickers[name](EVERY_FILTER_ON, None).name for name in PLUGINS.pickers] == list(PLUGINS.pickers)
    for name in (*PLUGINS.filters, *PLUGINS.scorers, *PLUGINS.pickers):
        assert name.isidentifier() and name == name.lower(), name


def test_the_configuration_names_the_scorers_the_registry_ships() -> None:
    assert tuple(PLUGINS.scorers) == SCORER_NAMES


def test_a_new_scorer_is_one_class_and_one_registry_entry() -> None:
    registry = PLUGINS.with_scorer("most_running", lambda settings: MostRunning())
    with_toy = registry.settings({"weights": {"inflight": 1.0, "most_running": 1.0}})
    assert {pick_among(with_toy, registry, seed) for seed in range(10)} == {"busy"}
    without = SchedulingSettings(weights={"inflight": 1.0})  # every worker ties: the picker draws
    assert len({pick_among(without, PLUGINS, seed) for seed in range(10)}) > 1


def test_a_section_naming_a_scorer_outside_the_registry_is_refused_with_its_field() -> None:
    registry = PLUGINS.with_scorer("most_running", lambda settings: MostRunning())
    with pytest.raises(ConfigError, match=r"scheduling\.weights: unknown scorer luck"):
        registry.settings({"weights": {"luck": 1.0}})
    toy = registry.settings({"weights": {"most_running": 1.0}})
    with pytest.raises(ConfigError, match=r"scheduling\.weights: unknown scorer most_running"):
        PLUGINS.scheduler(toy)
