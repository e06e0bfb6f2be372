"""Which live fields one scrape yields, and which changes are worth announcing."""

from __future__ import annotations

from typing import Any

import pytest

from agent.gpus import MIB, GpuSummary
from agent.live import live_fields, notable_change
from agent.rates import RateState
from agent.vllm_metrics import EngineMetrics
from poolgate.kernel.fleet import LIVE_FIELDS

FULL = EngineMetrics(running=3, waiting=1, kv_usage=0.41234, kv_block_size=16, num_gpu_blocks=1000,
                     preemptions_total=2.0, sim_gpu_memory_total_bytes=8192 * MIB,
                     sim_gpu_memory_used_bytes=6144 * MIB, sim_gpu_utilization=0.5,
                     lora_adapters=("sql", "chat"), max_loras=2, sleep_level=0,
                     waiting_by_reason=(("capacity", 1),))


def test_full_scrape_fills_every_live_field_but_state() -> None:
    rates = RateState(ttft_ewma_s=0.125, prefill_tokens_per_s=5000.0, prefix_cache_hit_rate=0.25,
                      inter_token_ewma_s=0.0375)
    fields = live_fields(FULL, rates, None)
    assert fields == {
        "kv_capacity_tokens": 16000, "kv_block_size": 16, "kv_usage": 0.4123, "running": 3, "waiting": 1,
        "preemptions_total": 2, "ttft_ewma_s": 0.125, "prefill_tokens_per_s": 5000.0, "inter_token_s": 0.0375,
        "gpu_memory_total_mib": 8192.0, "gpu_memory_free_mib": 2048.0, "gpu_utilization": 0.5,
        "lora_adapters": '["sql","chat"]', "max_loras": 2, "sleep_level": 0, "prefix_cache_hit_rate": 0.25,
        "waiting_deferred": 0,
    }
    assert set(fields) == set(LIVE_FIELDS) - {"state", "updated_at", "metrics_at"}


def test_unknown_facts_are_left_out() -> None:
    assert live_fields(EngineMetrics(), RateState(), None) == {}
    assert live_fields(EngineMetrics(kv_block_size=16), RateState(), None) == {}


def test_nvml_wins_over_simulated_gpu() -> None:
    fields = live_fields(FULL, RateState(), GpuSummary(memory_total_mib=81559.0, memory_free_mib=1000.0,
                                                       utilization=0.9))
    assert (fields["gpu_memory_total_mib"], fields["gpu_memory_free_mib"], fields["gpu_utilization"]) == (
        81559.0, 1000.0, 0.9)


BASE: dict[str, Any] = {"kv_usage": 0.40, "waiting": 0, "running": 2, "kv_capacity_tokens": 16000}


@pytest.mark.parametrize(("change", "expected"), [
    ({}, False),
    ({"running": 5}, False),                  # extproc counts its own in-flight; not worth a message
    ({"kv_usage": 0.44}, False),
    ({"kv_usage": 0.46}, True),
    ({"kv_usage": 0.34}, True),
    ({"waiting": 1}, True),
    ({"kv_capacity_tokens": 32000}, True),
    ({"ttft_ewma_s": 0.2}, False),
])
def test_notable_change(change: dict[str, Any], expected: bool) -> None:
    assert notable_change(BASE, {**BASE, **change}) is expected


def test_first_write_and_kv_appearing_are_notable() -> None:
    assert notable_change(None, BASE)
    without_kv = {k: v for k, v in BASE.items() if k != "kv_usage"}
    assert notable_change(without_kv, BASE)
    assert not notable_change(without_kv, without_kv)
