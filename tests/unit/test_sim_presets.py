"""Preset sizing and step-time figures stay near what the docstring promises."""

from __future__ import annotations

import pytest

from simworker.presets import PRESETS, ModelShape, default_num_gpu_blocks, step_cost


def test_kv_bytes_per_token_of_an_8b_model() -> None:
    assert ModelShape().kv_bytes_per_token == 128 * 1024


@pytest.mark.parametrize(("preset", "blocks_low", "blocks_high", "decode_ms_low", "decode_ms_high"), [
    ("h100-80gb", 25_000, 32_000, 7.0, 10.0),
    ("l4-24gb", 1_500, 2_500, 50.0, 80.0),
])
def test_presets(preset: str, blocks_low: int, blocks_high: int, decode_ms_low: float,
                 decode_ms_high: float) -> None:
    gpu, model = PRESETS[preset], ModelShape()
    assert blocks_low <= default_num_gpu_blocks(gpu, model, 16) <= blocks_high
    batch_1_ms = step_cost(gpu, model).step_seconds(1, 1000) * 1000
    assert decode_ms_low <= batch_1_ms <= decode_ms_high


def test_bigger_card_is_faster_and_holds_more() -> None:
    model = ModelShape()
    h100, l4 = PRESETS["h100-80gb"], PRESETS["l4-24gb"]
    assert default_num_gpu_blocks(h100, model, 16) > 10 * default_num_gpu_blocks(l4, model, 16)
    assert step_cost(h100, model).step_seconds(64, 64_000) < step_cost(l4, model).step_seconds(64, 64_000) / 5
