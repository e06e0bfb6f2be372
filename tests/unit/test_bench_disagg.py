"""The disaggregation benchmark's pure parts: the split fleet's config, the histogram reading, the targets."""

from __future__ import annotations

import math

from bench.disagg import DISAGGREGATED, bucket_quantile, hop_target, markdown, targets
from bench.sched_fleet import LAYOUTS, fleet_config, plan_workers
from poolgate.kernel.config import parse_config


def test_split_fleet_has_the_same_gpus_and_a_valid_config() -> None:
    def gpus(layout: object) -> list[str]:
        return sorted(preset for _, preset, count in layout.groups for _ in range(count))  # type: ignore[attr-defined]

    assert gpus(DISAGGREGATED) == gpus(LAYOUTS["homogeneous"])
    config = parse_config(fleet_config(plan_workers(DISAGGREGATED), 0.5, DISAGGREGATED))
    roles = {pool.name: pool.role for pool in config.pools}
    assert roles == {"chat": "decode", "code": "both", "chat-prefill": "prefill"}
    assert config.disaggregated_models() == {"llama-3.1-8b-instruct"}
    plain = parse_config(fleet_config(plan_workers(LAYOUTS["homogeneous"]), 0.5, LAYOUTS["homogeneous"]))
    assert plain.disaggregated_models() == frozenset()


def test_bucket_quantile_is_the_upper_bound_of_the_bucket() -> None:
    buckets = [(0.001, 10.0), (0.01, 90.0), (0.1, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(buckets, 0.5) == 0.01
    assert bucket_quantile(buckets, 0.05) == 0.001
    assert math.isnan(bucket_quantile([], 0.5))


def test_targets_report_misses_with_figures() -> None:
    aggregated = {"itl_p99_s": 0.08, "ttft_p99_s": 1.0, "goodput_ratio": 0.9}
    sidecar = {"overhead_p50_ms": 0.5, "overhead_p99_ms": 2.5, "prefill_p50_ms": 250.0,
               "decode_first_byte_p50_ms": 25.0, "counts": {}}
    split = {"itl_p99_s": 0.05, "ttft_p99_s": 0.9, "goodput_ratio": 0.95, "sidecar": sidecar}
    met = {name: ok for name, ok, _ in targets(aggregated, split)}
    assert met == {"ITL p99 ≤ 0.5× aggregated": False, "TTFT p99 no worse": True, "goodput ≥ aggregated": True,
                   "sidecar ≤ 1 ms median before the first byte": True}
    assert hop_target({"added_p50_ms": 2.0, "direct_p50_ms": 1.0, "sidecar_p50_ms": 3.0})[1] is False
    row = {"variant": "x", "fleet": "f", "sent": 1, "errors": 0, "ttft_p50_s": 0.1, "itl_p50_s": 0.01,
           "tpot_p99_s": 0.02}
    text = markdown({"load": "load average 1", "rate": 1.0, "window_model_s": 10.0, "time_scale": 0.5, "seed": 1,
                     "min_prompt_tokens": 2048, "rows": [{**row, **aggregated}, {**row, **split}],
                     "hop": {"added_p50_ms": 0.4, "direct_p50_ms": 1.0, "sidecar_p50_ms": 1.4}})
    assert "| ITL p99 ≤ 0.5× aggregated | MISSED | 50.0 ms vs 80.0 ms |" in text
    assert "sidecar hop ≤ 1 ms median added to the first byte | yes" in text
