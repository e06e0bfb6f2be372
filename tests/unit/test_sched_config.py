"""The scheduling section of the configuration: defaults that work, bad values named by their field path."""

from __future__ import annotations

import pytest

from poolgate.kernel.config import SCORER_NAMES, ConfigError, parse_config

POOLS = {"pools": [{"name": "chat", "model": "m"}]}


def test_defaults_weigh_every_scorer() -> None:
    scheduling = parse_config(POOLS).scheduling
    assert set(scheduling.weights) == set(SCORER_NAMES)
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
])
def test_bad_scheduling_values_name_their_field(scheduling: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**POOLS, "scheduling": scheduling}, "test.yaml")
    assert expected in str(info.value)


def test_unknown_task_class_names_the_pool_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"pools": [{"name": "chat", "model": "m", "task_classes": ["batch"]}]})
    assert "pools.0.task_classes.0" in str(info.value)
