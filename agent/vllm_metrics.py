"""Read the facts routing needs out of a vLLM ``/metrics`` page (Prometheus text).

Works for V1 engines (``engine="k"`` label on every engine series, ``vllm:kv_cache_usage_perc``) and the
older V0 engine (no ``engine`` label, ``vllm:gpu_cache_usage_perc``). A data-parallel server shows one
series per engine: counts and counters are summed, KV usage is averaged. A family that is absent stays
``None`` (unknown) so callers never mistake "not exported" for zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from poolgate.kernel.errors import PoolgateError

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
"""Name used before vLLM V1; some releases export both, and then the new one wins."""
CACHE_CONFIG = "vllm:cache_config_info"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
PREFILL_TIME_SUM = "vllm:request_prefill_time_seconds_sum"
LORA_INFO = "vllm:lora_requests_info"
"""LoRA adapters in use: labels ``running_lora_adapters`` / ``waiting_lora_adapters`` (comma lists) and
``max_lora``; the value is a timestamp and old label sets linger, so the series with the largest value is
the current one."""
SIM_GPU_MEMORY_TOTAL = "poolgate_sim_gpu_memory_total_bytes"
SIM_GPU_MEMORY_USED = "poolgate_sim_gpu_memory_used_bytes"
SIM_GPU_UTILIZATION = "poolgate_sim_gpu_utilization"

_SUMMED = (RUNNING, WAITING, PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, TTFT_SUM, TTFT_COUNT, PREFILL_TIME_SUM,
           SIM_GPU_MEMORY_TOTAL, SIM_GPU_MEMORY_USED)
_AVERAGED = (KV_USAGE, KV_USAGE_LEGACY, SIM_GPU_UTILIZATION)
_WANTED = frozenset((*_SUMMED, *_AVERAGED, CACHE_CONFIG, LORA_INFO))


class MetricsFormatError(PoolgateError, ValueError):
    """The page is not Prometheus text exposition."""


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of one worker. ``None`` = the worker does not export that fact."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Share of KV blocks in use, 0..1."""
    kv_block_size: int | None = None
    num_gpu_blocks: int | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft_sum_s: float | None = None
    ttft_count: float | None = None
    prefill_time_sum_s: float | None = None
    """Total time requests spent in prefill (V1 engines); with prompt tokens it gives the prefill rate."""
    sim_gpu_memory_total_bytes: float | None = None
    sim_gpu_memory_used_bytes: float | None = None
    sim_gpu_utilization: float | None = None
    lora_adapters: tuple[str, ...] | None = None
    """Adapters with requests running or waiting (running first); None = LoRA metric not exported."""
    max_loras: int | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.kv_block_size is None or self.num_gpu_blocks is None:
            return None
        return self.kv_block_size * self.num_gpu_blocks


def parse_engine_metrics(text: str, model_name: str | None = None) -> EngineMetrics:
    """Parse one ``/metrics`` page. With ``model_name``, only engine series labelled with that served name
    (or with no ``model_name`` label, as V0's cache config) count; otherwise every engine series does."""
    try:
        samples = list(_samples(text))
    except ValueError as exc:  # prometheus_client reports every malformed line as ValueError
        raise MetricsFormatError(f"not Prometheus text: {exc}") from exc
    values: dict[str, list[float]] = {}
    cache_configs: list[Mapping[str, str]] = []
    lora: Sample | None = None
    for sample in samples:
        if model_name is not None and sample.labels.get("model_name", model_name) != model_name:
            continue
        if sample.name == CACHE_CONFIG:
            cache_configs.append(sample.labels)
        elif sample.name == LORA_INFO:
            lora = sample if lora is None or sample.value >= lora.value else lora
        else:
            values.setdefault(sample.name, []).append(sample.value)

    def total(name: str) -> float | None:
        found = values.get(name)
        return sum(found) if found else None

    def mean(name: str) -> float | None:
        found = values.get(name)
        return sum(found) / len(found) if found else None

    def count(name: str) -> int | None:
        value = total(name)
        return None if value is None else int(value)

    kv_usage = mean(KV_USAGE)
    if kv_usage is None:
        kv_usage = mean(KV_USAGE_LEGACY)
    block_size, num_gpu_blocks = _cache_geometry(cache_configs)
    return EngineMetrics(
        running=count(RUNNING), waiting=count(WAITING),
        kv_usage=None if kv_usage is None else min(1.0, max(0.0, kv_usage)),
        kv_block_size=block_size, num_gpu_blocks=num_gpu_blocks,
        preemptions_total=total(PREEMPTIONS), prompt_tokens_total=total(PROMPT_TOKENS),
        generation_tokens_total=total(GENERATION_TOKENS),
        ttft_sum_s=total(TTFT_SUM), ttft_count=total(TTFT_COUNT), prefill_time_sum_s=total(PREFILL_TIME_SUM),
        sim_gpu_memory_total_bytes=total(SIM_GPU_MEMORY_TOTAL),
        sim_gpu_memory_used_bytes=total(SIM_GPU_MEMORY_USED),
        sim_gpu_utilization=mean(SIM_GPU_UTILIZATION),
        lora_adapters=None if lora is None else _adapters(lora.labels),
        max_loras=None if lora is None else _positive_int(lora.labels.get("max_lora")) or 0,
    )


def _adapters(labels: Mapping[str, str]) -> tuple[str, ...]:
    names = [*labels.get("running_lora_adapters", "").split(","), *labels.get("waiting_lora_adapters", "").split(",")]
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


def _samples(text: str) -> Iterable[Sample]:
    # The parser wants a final newline; V0 servers (and some proxies) omit it.
    if not text.endswith("\n"):
        text += "\n"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WANTED:
                yield sample


def _cache_geometry(configs: list[Mapping[str, str]]) -> tuple[int | None, int | None]:
    """Block size and total GPU blocks over all engines; unknown unless every engine reports both."""
    block_size: int | None = None
    blocks = 0
    for labels in configs:
        size = _positive_int(labels.get("block_size"))
        engine_blocks = _positive_int(labels.get("num_gpu_blocks"))
        if size is None or engine_blocks is None:
            return None, None
        block_size = size if block_size is None else block_size
        if size != block_size:  # engines disagree: no single block size to publish
            return None, None
        blocks += engine_blocks
    return (block_size, blocks) if block_size is not None else (None, None)


def _positive_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(float(text))
    except ValueError:  # vLLM writes "None" for unset fields
        return None
    return value if value > 0 else None
