"""Turn one replayed trace into a row of figures: what the client saw plus what the workers counted.

Times in rows are model (simulated GPU) seconds: wall seconds × the time scale. Every sent request counts:
one that was refused (429), failed, or cut before its first token (timed out) misses its SLO and enters
the TTFT percentiles as +∞, so a router cannot look faster by shedding. Time per output token (TPOT) is
``(e2e − TTFT) / (tokens − 1)`` over requests that streamed at least two tokens. The prefix-cache hit rate
is token-weighted from the workers' own counters (``vllm:prefix_cache_hits`` / ``…_queries``). Harness
health is in wall time: it is about the host, not the modelled GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.harness import lag_quantile
from bench.loadgen import Outcome

Scrapes = Mapping[str, Mapping[str, float]]


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile; +∞ entries sort last, so a tail of misses gives +∞."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def counter_delta(before: Scrapes, after: Scrapes, name: str) -> float:
    """A counter's growth summed over the workers (a worker missing before counts from 0)."""
    return sum(after[w].get(name, 0.0) - before.get(w, {}).get(name, 0.0) for w in after)


def merged(scrapes: Scrapes) -> dict[str, float]:
    total: dict[str, float] = {}
    for samples in scrapes.values():
        for key, value in samples.items():
            total[key] = total.get(key, 0.0) + value
    return total


def ttft_model_s(outcome: Outcome, time_scale: float) -> float:
    """TTFT in model seconds; +∞ for a request that never got a first token (refused, failed, timed out)."""
    return outcome.ttft_s * time_scale if outcome.ttft_s is not None else math.inf


def tpot_model_s(outcome: Outcome, time_scale: float) -> float | None:
    if outcome.ttft_s is None or outcome.e2e_s is None or outcome.tokens < 2:
        return None
    return (outcome.e2e_s - outcome.ttft_s) * time_scale / (outcome.tokens - 1)


def within_slo(outcome: Outcome, time_scale: float) -> bool:
    return outcome.error is None and ttft_model_s(outcome, time_scale) <= outcome.spec.slo_ttft_s


def client_figures(outcomes: Sequence[Outcome], time_scale: float, class_names: Sequence[str]) -> dict[str, Any]:
    """What the client saw: counts, TTFT/TPOT/e2e percentiles, goodput overall and per class."""
    ttfts = [ttft_model_s(o, time_scale) for o in outcomes]
    tpots = [t for o in outcomes if (t := tpot_model_s(o, time_scale)) is not None]
    e2es = [o.e2e_s * time_scale for o in outcomes if o.e2e_s is not None]
    good = [within_slo(o, time_scale) for o in outcomes]
    by_class: dict[str, float] = {}
    for name in class_names:
        flags = [g for g, o in zip(good, outcomes, strict=True) if o.spec.workload == name]
        by_class[name] = sum(flags) / len(flags) if flags else math.nan
    return {
        "sent": len(outcomes), "completed": sum(o.completed for o in outcomes),
        "refused": sum(o.refused for o in outcomes),
        "errors": sum(o.error is not None and not o.refused for o in outcomes),
        "cut": sum(o.cut for o in outcomes), "timed_out": sum(o.cut and o.ttft_s is None for o in outcomes),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "tpot_p50_s": percentile(tpots, 0.5), "tpot_p99_s": percentile(tpots, 0.99),
        "e2e_p99_s": percentile(e2es, 0.99),
        "itl_p99_s": percentile([g * time_scale for o in outcomes for g in o.token_gaps_s], 0.99),
        "itl_p50_s": percentile([g * time_scale for o in outcomes for g in o.token_gaps_s], 0.5),
        "goodput_ratio": sum(good) / len(good) if good else math.nan,
        "goodput_by_class": by_class,
        "output_tokens": sum(o.tokens for o in outcomes),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:3],
        "ttft_samples_s": sorted(round(t, 4) for t in ttfts if math.isfinite(t)),
        "slowest": slowest(outcomes, ttfts, time_scale),
    }


SLOWEST_KEPT = 10


def slowest(outcomes: Sequence[Outcome], ttfts: Sequence[float], time_scale: float) -> list[dict[str, Any]]:
    """The requests behind the tail, slowest first: when each was sent (model seconds from the run's start),
    its class and size, and its TTFT. A p99 alone cannot tell a start-up stall (all early) from a policy's
    queue (spread over the run) or one worker's backlog."""
    ranked = sorted(zip(ttfts, outcomes, strict=True), key=lambda pair: -pair[0])[:SLOWEST_KEPT]
    return [{"index": o.spec.index, "sent_s": round(o.sent_s * time_scale, 3), "workload": o.spec.workload,
             "prompt_tokens": o.spec.prompt_tokens, "ttft_s": round(t, 4) if math.isfinite(t) else "inf",
             "status": o.status} for t, o in ranked]


def worker_figures(before: Scrapes, after: Scrapes) -> dict[str, Any]:
    """What the workers counted between two scrapes."""
    queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
    hits = counter_delta(before, after, "vllm:prefix_cache_hits_total")
    return {
        "preemptions": int(counter_delta(before, after, "vllm:num_preemptions_total")),
        "prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits),
        "prefix_hit_rate": hits / queries if queries else math.nan,
        "worker_generation_tokens": {w: int(after[w].get("vllm:generation_tokens_total", 0.0)
                                            - before.get(w, {}).get("vllm:generation_tokens_total", 0.0))
                                     for w in after},
    }


def health_figures(outcomes: Sequence[Outcome], before: Scrapes, after: Scrapes, *, cpu_busy_share: float,
                   bench_cpu_cores: float) -> dict[str, float]:
    steps = counter_delta(before, after, "poolgate_sim_step_lag_seconds_count")
    lag_sum = counter_delta(before, after, "poolgate_sim_step_lag_seconds_sum")
    modelled = counter_delta(before, after, "poolgate_sim_modelled_step_seconds_total")
    lateness = [o.lateness_s for o in outcomes]
    return {
        "arrival_lateness_p99_ms": percentile(lateness, 0.99) * 1000,
        "arrival_lateness_max_ms": max(lateness, default=math.nan) * 1000,
        "sim_step_lag_mean_ms": lag_sum / steps * 1000 if steps else math.nan,
        "sim_step_lag_p99_ms": lag_quantile(merged(before), merged(after), 0.99) * 1000,
        "sim_lag_share": lag_sum / modelled if modelled else math.nan,
        "host_cpu_busy": cpu_busy_share,
        "bench_cpu_cores": bench_cpu_cores,
    }


def summarise_run(router: str, level: float, offered_rps: float, outcomes: Sequence[Outcome],
                  before: Scrapes, after: Scrapes, *, time_scale: float, window_s: float, window_tokens: int,
                  class_names: Sequence[str], cpu_busy_share: float, bench_cpu_cores: float) -> dict[str, Any]:
    """One row of a report: a router at a load level."""
    return {
        "policy": router, "level": level, "offered_rps": offered_rps,
        **client_figures(outcomes, time_scale, class_names),
        **worker_figures(before, after),
        "output_tokens_per_s": window_tokens / (window_s * time_scale),
        "health": health_figures(outcomes, before, after, cpu_busy_share=cpu_busy_share,
                                 bench_cpu_cores=bench_cpu_cores),
    }


def json_safe(value: Any) -> Any:
    """Infinities and NaNs as strings ("inf", "nan"): report.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
