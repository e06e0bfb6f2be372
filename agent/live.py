"""From one scrape (plus rates and GPUs) to the live fields of a worker's record, and when to announce.

Only known facts are written: a family the worker does not export leaves the stored value alone. An
announcement (pub/sub) makes extproc refresh at once instead of at its next poll; it is sent only on changes
that move picks, so a busy fleet does not flood the channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from agent.gpus import MIB, GpuSummary
from agent.rates import RateState
from agent.vllm_metrics import EngineMetrics

KV_USAGE_NOTABLE = 0.05
"""KV usage change (share of capacity) that is worth an announcement."""


def live_fields(metrics: EngineMetrics, rates: RateState, gpus: GpuSummary | None) -> dict[str, Any]:
    """Live ``WorkerRecord`` fields known from this scrape (``updated_at`` is the writer's)."""
    fields: dict[str, Any] = {}
    if metrics.kv_capacity_tokens is not None and metrics.kv_block_size is not None:
        fields["kv_capacity_tokens"] = metrics.kv_capacity_tokens
        fields["kv_block_size"] = metrics.kv_block_size
    if metrics.kv_usage is not None:
        fields["kv_usage"] = round(metrics.kv_usage, 4)
    if metrics.running is not None:
        fields["running"] = metrics.running
    if metrics.waiting is not None:
        fields["waiting"] = metrics.waiting
    if metrics.preemptions_total is not None:
        fields["preemptions_total"] = int(metrics.preemptions_total)
    if rates.ttft_ewma_s >= 0:
        fields["ttft_ewma_s"] = round(rates.ttft_ewma_s, 6)
    if rates.prefill_tokens_per_s > 0:
        fields["prefill_tokens_per_s"] = round(rates.prefill_tokens_per_s, 1)
    if rates.inter_token_ewma_s >= 0:
        fields["inter_token_s"] = round(rates.inter_token_ewma_s, 6)
    if metrics.sleep_level is not None:
        fields["sleep_level"] = metrics.sleep_level
    if rates.prefix_cache_hit_rate >= 0:
        fields["prefix_cache_hit_rate"] = round(rates.prefix_cache_hit_rate, 4)
    if metrics.waiting_by_reason is not None:
        fields["waiting_deferred"] = sum(n for reason, n in metrics.waiting_by_reason if reason != "capacity")
    if metrics.lora_adapters is not None:
        fields["lora_adapters"] = orjson.dumps(list(metrics.lora_adapters)).decode()
        fields["max_loras"] = metrics.max_loras or 0
    fields.update(_gpu_fields(metrics, gpus))
    return fields


def _gpu_fields(metrics: EngineMetrics, gpus: GpuSummary | None) -> dict[str, float]:
    """NVML for the worker's own GPUs when known; else the simulated card a simworker reports."""
    if gpus is not None:
        return {"gpu_memory_total_mib": round(gpus.memory_total_mib, 1),
                "gpu_memory_free_mib": round(gpus.memory_free_mib, 1),
                "gpu_utilization": round(gpus.utilization, 4)}
    fields: dict[str, float] = {}
    total, used = metrics.sim_gpu_memory_total_bytes, metrics.sim_gpu_memory_used_bytes
    if total is not None:
        fields["gpu_memory_total_mib"] = round(total / MIB, 1)
        if used is not None:
            fields["gpu_memory_free_mib"] = round(max(0.0, total - used) / MIB, 1)
    if metrics.sim_gpu_utilization is not None:
        fields["gpu_utilization"] = round(min(1.0, max(0.0, metrics.sim_gpu_utilization)), 4)
    return fields


def notable_change(announced: Mapping[str, Any] | None, current: Mapping[str, Any]) -> bool:
    """Whether ``current`` differs from the facts last announced enough to move routing decisions."""
    if announced is None:
        return True
    for key in ("waiting", "kv_capacity_tokens", "sleep_level"):  # a worker falling asleep or waking moves picks
        if current.get(key) != announced.get(key):
            return True
    before, now = announced.get("kv_usage"), current.get("kv_usage")
    if before is None or now is None:
        return (before is None) != (now is None)
    return abs(float(now) - float(before)) > KV_USAGE_NOTABLE
