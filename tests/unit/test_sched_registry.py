"""The plugin registry: every plugin under its snake_case name, the configuration checked against it, and a
new scorer with a setting of its own added by writing one module file (a toy one, written by the test)."""

from __future__ import annotations

import importlib
import random
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from extproc.request import RequestFacts
from extproc.scheduling import PLUGINS, Decision, PickContext, PickRequest, scorers
from extproc.scheduling.plugins import NoSettings, ScorerPlugin
from extproc.scheduling.registry import discover
from extproc.snapshot import build_snapshot
from poolgate import config_doc
from poolgate.kernel.config import ConfigError, PoolSpec, SchedulingSettings, parse_config
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


def test_the_shipped_scorers_keep_their_default_weights() -> None:
    assert PLUGINS.default_weights == {"predicted_ttft": 0.0, "kv_headroom": 0.0, "inflight": 0.0,
                                       "prefix_affinity": 0.0, "lora_affinity": 2.0, "cache_aware_ttft": 0.0,
                                       "latency": 1.0}
    assert PLUGINS.weights(SchedulingSettings()) == PLUGINS.default_weights
    assert PLUGINS.weights(SchedulingSettings(weights={"inflight": 1.0})) == {"inflight": 1.0}


def test_every_scorer_module_declares_its_plugin() -> None:
    assert len(PLUGINS.scorers) == len(list(Path(scorers.__file__).parent.glob("[!_]*.py")))


def test_a_new_scorer_is_one_class_and_one_declaration() -> None:
    registry = PLUGINS.with_scorer(ScorerPlugin("most_running", lambda own, shared: MostRunning(), NoSettings))
    with_toy = registry.settings({"weights": {"inflight": 1.0, "most_running": 1.0}})
    assert {pick_among(with_toy, registry, seed) for seed in range(10)} == {"busy"}
    without = SchedulingSettings(weights={"inflight": 1.0})  # every worker ties: the picker draws
    assert len({pick_among(without, PLUGINS, seed) for seed in range(10)}) > 1


def test_a_section_naming_a_scorer_outside_the_registry_is_refused_with_its_field() -> None:
    registry = PLUGINS.with_scorer(ScorerPlugin("most_running", lambda own, shared: MostRunning(), NoSettings))
    with pytest.raises(ConfigError, match=r"scheduling\.weights: unknown scorer luck"):
        registry.settings({"weights": {"luck": 1.0}})
    toy = registry.settings({"weights": {"most_running": 1.0}})
    with pytest.raises(ConfigError, match=r"scheduling\.weights: unknown scorer most_running"):
        PLUGINS.scheduler(toy)


BUSIEST_MODULE = textwrap.dedent('''
    """Busiest: prefer the worker running the most requests, score(w) = running_w / max(running), 0 below
    ``min_running`` (a toy scorer, written by a test)."""

    from pydantic import Field

    from extproc.scheduling.plugins import ScorerPlugin
    from poolgate.kernel.config import Section


    class BusiestSettings(Section):
        min_running: int = Field(0, ge=0)
        """Workers running fewer requests than this score 0."""


    class Busiest:
        name = "busiest"

        def __init__(self, min_running: int) -> None:
            self.min_running = min_running

        def score(self, request, candidates, context):
            most = max(w.running for w in candidates)
            return [w.running / most if most and w.running >= self.min_running else 0.0 for w in candidates]


    PLUGIN = ScorerPlugin("busiest", lambda own, shared: Busiest(own.min_running), BusiestSettings)
''')


@pytest.fixture
def busiest_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``busiest.py`` written into a folder that joins the scorers package's search path, as a file dropped
    into ``extproc/scheduling/scorers/`` would (without touching the source tree)."""
    path = tmp_path / "busiest.py"
    path.write_text(BUSIEST_MODULE)
    monkeypatch.setattr(scorers, "__path__", [*scorers.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    yield path
    sys.modules.pop(f"{scorers.__name__}.busiest", None)


def test_a_new_scorer_with_a_setting_of_its_own_is_one_new_file(busiest_file: Path) -> None:
    registry = discover()  # what extproc builds at import: every module of the scorers package
    assert set(registry.scorers) - set(PLUGINS.scorers) == {"busiest"}
    assert registry.default_weights["busiest"] == 0.0  # declared default: an existing config is unchanged
    assert list(registry.filters) == list(PLUGINS.filters)

    # configurable by name, its setting validated by its own model, with the field path
    section = {"weights": {"busiest": 1.0}, "scorer_settings": {"busiest": {"min_running": 3}}}
    settings = registry.settings(section)
    with pytest.raises(ConfigError, match=r"scheduling\.scorer_settings\.busiest\.min_running: Input should be "
                                          r"greater than or equal to 0"):
        registry.settings({**section, "scorer_settings": {"busiest": {"min_running": -1}}})
    with pytest.raises(ConfigError, match=r"scheduling\.scorer_settings\.busiest\.most: Extra inputs"):
        registry.check(parse_config({"pools": [{"name": "chat", "model": "llama"}],
                                     "scheduling": {"scorer_settings": {"busiest": {"most": 1}}}}).scheduling)
    with pytest.raises(ConfigError, match=r"scheduling\.scorer_settings: unknown scorer busiest"):
        PLUGINS.check(settings)  # the registry without the file does not know it

    # used by the scheduler, with its setting: the busiest worker always; above every worker's load, a draw
    assert {pick_among(settings, registry, seed) for seed in range(10)} == {"busy"}
    nobody = registry.settings({**section, "scorer_settings": {"busiest": {"min_running": 9}}})
    assert len({pick_among(nobody, registry, seed) for seed in range(10)}) > 1

    # and the configuration reference documents it
    doc = config_doc.render(registry)
    assert "| `busiest` | 0 | `scheduling.scorer_settings.busiest` | Busiest |" in doc
    assert "## `scheduling.scorer_settings.busiest`" in doc and "| `min_running` | `int` | `0` |" in doc
