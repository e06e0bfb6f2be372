"""Read the facts routing needs out of a vLLM ``/metrics`` page (Prometheus text).

Works for V1 engines (``engine="k"`` label on every engine series, ``vllm:kv_cache_usage_perc``) and the
older V0 engine (no ``engine`` label, ``vllm:gpu_cache_usage_perc``). A data-parallel server shows one
series per engine: counts and counters are summed, KV usage is averaged. A family that is absent stays
``None`` (unknown) so callers never mistake "not exported" for zero.

An agent reads every worker's page four times a second, and a real page is mostly histogram buckets the agent
never reads: only the lines of the wanted families go to the Prometheus parser (the others are only checked to
start with a metric name, so a page that is not Prometheus text is still refused). Parsing whole pages took a
fifth of a core for four simulated workers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from poolgate.kernel.errors import UpstreamError

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
INTER_TOKEN_SUM = "vllm:inter_token_latency_seconds_sum"
INTER_TOKEN_COUNT = "vllm:inter_token_latency_seconds_count"
"""Time between a stream's tokens (V1 engines); V0 engines name it ``vllm:time_per_output_token_seconds``."""
INTER_TOKEN_SUM_V0 = "vllm:time_per_output_token_seconds_sum"
INTER_TOKEN_COUNT_V0 = "vllm:time_per_output_token_seconds_count"
LORA_INFO = "vllm:lora_requests_info"
"""LoRA adapters in use: labels ``running_lora_adapters`` / ``waiting_lora_adapters`` (comma lists) and
``max_lora``; the value is a timestamp and old label sets linger, so the series with the largest value is
the current one."""
SLEEP_STATE = "vllm:engine_sleep_state"
"""vLLM's sleep mode (``POST /sleep``): one series per ``sleep_state`` label, ``awake`` 1 while awake,
``weights_offloaded`` 1 at sleep level 1, ``discard_all`` 1 at level 2. A sleeping engine still answers
``/health`` 200 and shows an empty queue, but cannot serve until ``POST /wake_up``."""
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
"""Prompt tokens the engine's prefix cache held, of those it looked up (V1 engines)."""
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
"""The waiting queue split by ``reason``: ``capacity`` (waiting for room) or ``deferred`` (held back by a
transient constraint: LoRA budget, KV transfer); the reasons sum to ``vllm:num_requests_waiting``."""
SIM_GPU_MEMORY_TOTAL = "poolgate_sim_gpu_memory_total_bytes"
SIM_GPU_MEMORY_USED = "poolgate_sim_gpu_memory_used_bytes"
SIM_GPU_UTILIZATION = "poolgate_sim_gpu_utilization"

_SUMMED = (RUNNING, WAITING, PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, TTFT_SUM, TTFT_COUNT, PREFILL_TIME_SUM,
           INTER_TOKEN_SUM, INTER_TOKEN_COUNT, INTER_TOKEN_SUM_V0, INTER_TOKEN_COUNT_V0, PREFIX_CACHE_HITS,
           PREFIX_CACHE_QUERIES, SIM_GPU_MEMORY_TOTAL, SIM_GPU_MEMORY_USED)
_AVERAGED = (KV_USAGE, KV_USAGE_LEGACY, SIM_GPU_UTILIZATION)
_LABELLED = (SLEEP_STATE, WAITING_BY_REASON)
"""Families whose meaning is in a label: kept with their labels, not summed blindly."""
_WANTED = frozenset((*_SUMMED, *_AVERAGED, *_LABELLED, CACHE_CONFIG, LORA_INFO))


class MetricsFormatError(UpstreamError, ValueError):
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
    inter_token_sum_s: float | None = None
    inter_token_count: float | None = None
    """Seconds between streamed tokens and how many gaps: their mean is how fast a running stream grows."""
    sim_gpu_memory_total_bytes: float | None = None
    sim_gpu_memory_used_bytes: float | None = None
    sim_gpu_utilization: float | None = None
    lora_adapters: tuple[str, ...] | None = None
    """Adapters with requests running or waiting (running first); None = LoRA metric not exported."""
    max_loras: int | None = None
    sleep_level: int | None = None
    """0 awake, 1 weights offloaded, 2 weights and cache discarded (the deepest of its engines); None = the
    worker does not export ``vllm:engine_sleep_state``."""
    prefix_cache_hits_total: float | None = None
    prefix_cache_queries_total: float | None = None
    waiting_by_reason: tuple[tuple[str, int], ...] | None = None
    """(reason, requests) of the waiting queue, summed over engines, by reason name."""

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
    labelled: dict[str, list[Sample]] = {}
    lora: Sample | None = None
    for sample in samples:
        if model_name is not None and sample.labels.get("model_name", model_name) != model_name:
            continue
        if sample.name == CACHE_CONFIG:
            cache_configs.append(sample.labels)
        elif sample.name in _LABELLED:
            labelled.setdefault(sample.name, []).append(sample)
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
        inter_token_sum_s=_either(total(INTER_TOKEN_SUM), total(INTER_TOKEN_SUM_V0)),
        inter_token_count=_either(total(INTER_TOKEN_COUNT), total(INTER_TOKEN_COUNT_V0)),
        sim_gpu_memory_total_bytes=total(SIM_GPU_MEMORY_TOTAL),
        sim_gpu_memory_used_bytes=total(SIM_GPU_MEMORY_USED),
        sim_gpu_utilization=mean(SIM_GPU_UTILIZATION),
        lora_adapters=None if lora is None else _adapters(lora.labels),
        max_loras=None if lora is None else _positive_int(lora.labels.get("max_lora")) or 0,
        sleep_level=_sleep_level(labelled.get(SLEEP_STATE, [])),
        prefix_cache_hits_total=total(PREFIX_CACHE_HITS), prefix_cache_queries_total=total(PREFIX_CACHE_QUERIES),
        waiting_by_reason=_by_reason(labelled.get(WAITING_BY_REASON, [])),
    )


def _either(current: float | None, legacy: float | None) -> float | None:
    """A V1 family, else its V0 name."""
    return current if current is not None else legacy


def _sleep_level(samples: list[Sample]) -> int | None:
    """The deepest sleep of the worker's engines: 2 when ``discard_all``, 1 when ``weights_offloaded`` or not
    ``awake``, else 0; None when the family is absent."""
    if not samples:
        return None
    engines: dict[str, dict[str, float]] = {}
    for sample in samples:
        engines.setdefault(sample.labels.get("engine", ""), {})[sample.labels.get("sleep_state", "")] = sample.value
    levels = [2 if states.get("discard_all", 0) >= 1 else
              1 if states.get("weights_offloaded", 0) >= 1 or states.get("awake", 1) < 1 else 0
              for states in engines.values()]
    return max(levels)


def _by_reason(samples: list[Sample]) -> tuple[tuple[str, int], ...] | None:
    if not samples:
        return None
    counts: dict[str, float] = {}
    for sample in samples:
        reason = sample.labels.get("reason", "")
        counts[reason] = counts.get(reason, 0.0) + sample.value
    return tuple(sorted((reason, int(count)) for reason, count in counts.items()))


def _adapters(labels: Mapping[str, str]) -> tuple[str, ...]:
    names = [*labels.get("running_lora_adapters", "").split(","), *labels.get("waiting_lora_adapters", "").split(",")]
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _wanted_lines(text: str) -> str:
    """The page's sample lines of the wanted families, newline-terminated (as the parser wants); ValueError for a
    line that does not start with a metric name."""
    kept = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _WANTED:
            kept.append(line)
        elif not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"not a sample line: {line[:80]!r}")
    return "".join(f"{line}\n" for line in kept)


def _samples(text: str) -> Iterable[Sample]:
    for family in text_string_to_metric_families(_wanted_lines(text)):
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
