"""Step time: attention's cost grows with prompt length squared, and steps carry a small seeded jitter.
Driven by a virtual clock over the real presets."""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import pytest

from simworker import cli
from simworker.engine import Engine, EngineConfig, EngineRequest
from simworker.presets import PRESETS, ModelShape, StepCost, attention_pairs, default_num_gpu_blocks, step_cost

MODEL = ModelShape()


def preset_engine(preset: str, jitter: float = 0.0, seed: int = 0, attention: bool = True) -> Engine:
    gpu = PRESETS[preset]
    cost = step_cost(gpu, MODEL)
    if not attention:
        cost = dataclasses.replace(cost, per_attention_pair_s=0.0)
    blocks = default_num_gpu_blocks(gpu, MODEL, 16)
    return Engine(EngineConfig(
        num_gpu_blocks=blocks, block_size=16, max_num_seqs=gpu.max_num_seqs,
        max_num_batched_tokens=gpu.max_num_batched_tokens, max_model_len=min(blocks * 16, 40_000),
        enable_prefix_caching=True, cost=cost, step_jitter=jitter, seed=seed))


def prefill_s(engine: Engine, prompt: int) -> float:
    """Time to the first token of one prompt alone (chunked by the batched-token budget)."""
    engine.add_request(EngineRequest("p", prompt, 1, "length"), 0.0)
    now = 0.0
    while engine.has_work:
        now = engine.step(now).end
    return now


def test_attention_pairs_of_chunks_add_up_to_the_whole_prompt() -> None:
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 8192) == 8192 * 8193 // 2
    assert attention_pairs(0, 3000) + attention_pairs(3000, 5192) == attention_pairs(0, 8192)
    assert attention_pairs(999, 1) == 1000  # a decode token attends to its whole context


@pytest.mark.parametrize(("preset", "prefill_8k_s", "prefill_16k_s"), [
    ("h100-80gb", 0.30, 0.67),
    ("l4-24gb", 2.7, 5.9),
])
def test_presets_table_prefill_columns(preset: str, prefill_8k_s: float, prefill_16k_s: float) -> None:
    assert prefill_s(preset_engine(preset), 8000) == pytest.approx(prefill_8k_s, rel=0.05)
    assert prefill_s(preset_engine(preset), 16000) == pytest.approx(prefill_16k_s, rel=0.05)


def test_long_prefills_cost_more_than_linearly() -> None:
    linear = {n: prefill_s(preset_engine("h100-80gb", attention=False), n) for n in (2000, 8000, 16000, 32000)}
    full = {n: prefill_s(preset_engine("h100-80gb"), n) for n in linear}
    extra = {n: full[n] / linear[n] - 1 for n in linear}
    assert extra[2000] < 0.05  # short prompts barely notice
    assert 0.10 < extra[8000] < 0.16
    assert 0.45 < extra[32000] < 0.55
    assert full[32000] / full[16000] > 2.3 > linear[32000] / linear[16000]


def test_attention_is_negligible_for_decode() -> None:
    cost = step_cost(PRESETS["h100-80gb"], MODEL)
    with_attention = cost.step_seconds(256, 256_000, 256 * 1001)
    assert with_attention < 1.01 * cost.step_seconds(256, 256_000)


def decode_step_times(seed: int, jitter: float, steps: int = 400) -> list[float]:
    engine = preset_engine("h100-80gb", jitter=jitter, seed=seed)
    engine.add_request(EngineRequest("d", 16, steps + 1, "length"), 0.0)
    now, times = 0.0, []
    engine.step(now)  # the prefill
    for _ in range(steps):
        outcome = engine.step(now)
        now = outcome.end
        times.append(outcome.duration_s)
    return times


def test_jitter_is_small_seeded_and_centred() -> None:
    exact = decode_step_times(seed=1, jitter=0.0)
    assert max(exact) - min(exact) < 0.01 * statistics.mean(exact)  # only the growing context moves it
    noisy = decode_step_times(seed=1, jitter=0.02)
    ratios = [n / e for n, e in zip(noisy, exact, strict=True)]
    assert 0.94 - 1e-9 <= min(ratios) and max(ratios) <= 1.06 + 1e-9
    assert statistics.stdev(ratios) == pytest.approx(0.02, rel=0.2)
    assert statistics.mean(ratios) == pytest.approx(1.0, abs=0.005)
    assert decode_step_times(seed=1, jitter=0.02) == noisy
    assert decode_step_times(seed=2, jitter=0.02) != noisy


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_seed_and_jitter_flags() -> None:
    default = cli.worker_specs(parse(["--ports", "8001", "8002"]))
    assert [spec.engine_config().step_jitter for spec in default] == [0.02, 0.02]
    assert default[0].engine_config().seed != default[1].engine_config().seed  # one process, distinct draws
    seeded = cli.worker_specs(parse(["--port", "8001", "--seed", "7", "--step-jitter", "0"]))[0]
    assert (seeded.seed, seeded.engine_config().step_jitter) == (7, 0.0)
    assert seeded.engine_config().seed != cli.worker_specs(parse(["--port", "8001"]))[0].engine_config().seed
    with pytest.raises(ValueError, match="--step-jitter"):
        cli.worker_specs(parse(["--step-jitter", "0.5"]))


def test_step_cost_defaults_keep_a_linear_model() -> None:
    cost = StepCost(fixed_s=0.01, per_scheduled_token_s=0.001, per_context_token_s=0.0)
    assert cost.step_seconds(10, 0, attention_pairs(0, 10)) == pytest.approx(0.02)
