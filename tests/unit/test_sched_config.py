"""The scheduling section of the configuration: defaults that work, bad values named by their field path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc import cli as extproc_cli
from extproc.scheduling import PLUGINS
from poolgate.cli import main as cli_main
from poolgate.kernel.config import ConfigError, parse_config

POOLS = {"pools": [{"name": "chat", "model": "m"}]}


def test_defaults_weigh_every_scorer() -> None:
    scheduling = parse_config(POOLS).scheduling
    assert scheduling.weights is None and scheduling.scorer_settings == {} == scheduling.filter_settings
    assert set(PLUGINS.weights(scheduling)) == set(PLUGINS.scorers)
    assert PLUGINS.weights(scheduling)["latency"] == 1.0 and PLUGINS.weights(scheduling)["lora_affinity"] == 2.0
    assert scheduling.max_wait_s > 0 and scheduling.retry_after_s >= 1 and scheduling.tokenizer_path is None


def test_a_streaming_only_pool() -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m"},
                                     {"name": "streams", "model": "m", "task_classes": ["streaming"]}]})
    assert config.pool("streams").task_classes == ("streaming",)


@pytest.mark.parametrize(("scheduling", "expected"), [
    ({"weights": {"kv_headroom": 1, "luck": 2}}, "scheduling.weights: unknown scorer luck"),
    ({"weights": {"inflight": -1}}, "scheduling.weights: inflight must be 0 or more"),
    ({"max_wait_s": 120}, "scheduling.max_wait_s"),
    ({"max_wait_s": -1}, "scheduling.max_wait_s"),
    ({"retry_after_s": 0}, "scheduling.retry_after_s"),
    ({"chars_per_token": 0}, "scheduling.chars_per_token"),
    ({"kv_reserve_fraction": 1.0}, "scheduling.kv_reserve_fraction"),
    ({"prefix_chunk_chars": 4}, "scheduling.prefix_chunk_chars"),
    ({"task_classes": {"long_context_min_tokens": 0}}, "scheduling.task_classes.long_context_min_tokens"),
    ({"debug_headers": True}, "scheduling.debug_headers: Extra inputs are not permitted"),
    ({"scorer_settings": {"latency": {"inflight_tokens": -1}}},
     "scheduling.scorer_settings.latency.inflight_tokens: Input should be greater than or equal to 0"),
    ({"scorer_settings": {"latency": {"inflight": 5}}},
     "scheduling.scorer_settings.latency.inflight: Extra inputs are not permitted"),
    ({"scorer_settings": {"luck": {}}}, "scheduling.scorer_settings: unknown scorer luck"),
    ({"filter_settings": {"kv_fits": {"reserve": 0.1}}},
     "scheduling.filter_settings.kv_fits.reserve: Extra inputs are not permitted"),
    ({"filter_settings": {"luck": {}}}, "scheduling.filter_settings: unknown filter luck"),
    ({"scorer_settings": {"latency": 3}}, "scheduling.scorer_settings.latency"),
])
def test_bad_scheduling_values_name_their_field(scheduling: dict[str, object], expected: str) -> None:
    """The loader checks the section's shape; the plugin registry (``poolgate config check``, extproc's start)
    the plugins' names and their own settings."""
    with pytest.raises(ConfigError) as info:
        PLUGINS.check(parse_config({**POOLS, "scheduling": scheduling}, "test.yaml").scheduling)
    assert expected in str(info.value)


def test_unknown_task_class_names_the_pool_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"pools": [{"name": "chat", "model": "m", "task_classes": ["batch"]}]})
    assert "pools.0.task_classes.0" in str(info.value)


BAD_PLUGINS = """pools: [{name: chat, model: m}]
scheduling:
  weights: {latency: 1, luck: 2}
  scorer_settings: {latency: {inflight_tokens: -5}}
"""


def test_config_check_and_extproc_refuse_bad_plugin_settings(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The loader cannot see the plugins; the two commands that read them check them before anything runs."""
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_PLUGINS)
    assert cli_main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "scheduling.weights: unknown scorer luck" in err
    assert "scheduling.scorer_settings.latency.inflight_tokens: Input should be greater than or equal to 0" in err
    parser = argparse.ArgumentParser()
    extproc_cli.add_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--redis-url", "redis://127.0.0.1:1/0"])
    assert extproc_cli.main(args) == 2
    assert "scheduling.scorer_settings.latency.inflight_tokens" in capsys.readouterr().err


def test_the_latency_scorer_reads_its_own_settings() -> None:
    default = PLUGINS.build_scorers(parse_config(POOLS).scheduling)["latency"]
    assert (default.inflight_tokens, default.eviction_weight) == (100, 1.0)  # type: ignore[attr-defined]
    section = {"scorer_settings": {"latency": {"inflight_tokens": 200, "eviction_weight": 0.5}}}
    tuned = PLUGINS.build_scorers(parse_config({**POOLS, "scheduling": section}).scheduling)["latency"]
    assert (tuned.inflight_tokens, tuned.eviction_weight) == (200, 0.5)  # type: ignore[attr-defined]
