"""Hardware presets: how big the KV cache is and how long one engine step takes.

The served model is a Llama-3-8B-class decoder in bf16: 8.03e9 parameters (16.06 GB of weights),
32 layers, 8 KV heads of 128 dims, so one token of KV cache is 2 (K, V) x 32 x 8 x 128 x 2 bytes
= 128 KiB and one 16-token block is 2 MiB.

KV capacity follows vLLM's rule: ``gpu_memory_utilization`` x card memory, minus weights, minus the
activation peak measured during profiling; the rest is cut into blocks.

Step time is an additive roofline (a slight over-estimate of the real ``max(memory, compute)``):

    step_s = overhead + weights / (bandwidth x eff_mem)                  # read all weights once
           + scheduled_tokens x 2 x params / (peak_flops x mfu)          # prefill and decode tokens
           + context_tokens x kv_bytes_per_token / (bandwidth x eff_mem) # attention reads the KV

Prefill attention's quadratic term is ignored (small below ~8k tokens for an 8B model).

============  ========  =========  =====  ==========  ========  =======  ========  ===========
preset        memory    bandwidth  bf16   KV blocks   KV tok    seqs     batched   batch-1
                                   TFLOPs (16 tok)                       tokens    decode step
============  ========  =========  =====  ==========  ========  =======  ========  ===========
h100-80gb     80 GiB    3.35 TB/s  989    ~28,100     ~450k     1024     8192      ~7.5 ms
l4-24gb       22.5 GiB  0.30 TB/s  121    ~2,200      ~35k      256      2048      ~68 ms
============  ========  =========  =====  ==========  ========  =======  ========  ===========

Sources: NVIDIA datasheets (H100 SXM 3.35 TB/s HBM3 and 989 dense bf16 TFLOPs; L4 300 GB/s and
121 TFLOPs), vLLM's defaults (utilization 0.9; 1024 seqs / 8192 tokens on >= 70 GiB cards, else
256 / 2048) and the commonly reported ~7-10 ms batch-1 decode and ~20-30k tokens/s prefill of an
8B model on one H100. Efficiencies: 80 % of peak bandwidth, 50 % MFU, 1.5 ms fixed overhead
(scheduler, sampling, kernel launches). Resulting H100 figures: prefill ~31k tokens/s,
decode at batch 256 with 1k-token contexts ~28 ms per step (~9k tokens/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder's shape that decide memory and compute."""

    parameters: float = 8.03e9
    bytes_per_parameter: int = 2
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    kv_bytes_per_element: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_parameter

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def flops_per_token(self) -> float:
        return 2 * self.parameters


@dataclass(frozen=True)
class GpuPreset:
    """One card serving one model replica, with vLLM's per-card scheduler defaults."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    activation_reserve_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.9
    memory_efficiency: float = 0.8
    model_flops_utilization: float = 0.5
    step_overhead_s: float = 0.0015


PRESETS: dict[str, GpuPreset] = {
    "h100-80gb": GpuPreset(
        name="h100-80gb", memory_bytes=80 * GIB, bandwidth_bytes_per_s=3.35e12, peak_flops=989e12,
        activation_reserve_bytes=2 * GIB, max_num_seqs=1024, max_num_batched_tokens=8192,
    ),
    "l4-24gb": GpuPreset(
        name="l4-24gb", memory_bytes=int(22.5 * GIB), bandwidth_bytes_per_s=0.30e12, peak_flops=121e12,
        activation_reserve_bytes=1 * GIB, max_num_seqs=256, max_num_batched_tokens=2048,
    ),
}
DEFAULT_PRESET = "h100-80gb"


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step as a linear function of what the step schedules."""

    fixed_s: float
    per_scheduled_token_s: float
    per_context_token_s: float

    def step_seconds(self, scheduled_tokens: int, context_tokens: int) -> float:
        if scheduled_tokens == 0:
            return 0.0
        return (self.fixed_s + scheduled_tokens * self.per_scheduled_token_s
                + context_tokens * self.per_context_token_s)


def step_cost(preset: GpuPreset, model: ModelShape) -> StepCost:
    effective_bandwidth = preset.bandwidth_bytes_per_s * preset.memory_efficiency
    return StepCost(
        fixed_s=preset.step_overhead_s + model.weight_bytes / effective_bandwidth,
        per_scheduled_token_s=model.flops_per_token / (preset.peak_flops * preset.model_flops_utilization),
        per_context_token_s=model.kv_bytes_per_token / effective_bandwidth,
    )


def default_num_gpu_blocks(preset: GpuPreset, model: ModelShape, block_size: int) -> int:
    """vLLM's sizing: whatever the utilization budget leaves after weights and activations."""
    budget = preset.memory_bytes * preset.gpu_memory_utilization
    kv_bytes = budget - model.weight_bytes - preset.activation_reserve_bytes
    blocks = math.floor(kv_bytes / (model.kv_bytes_per_token * block_size))
    if blocks <= 0:
        raise ValueError(f"preset {preset.name}: the model does not fit (no memory left for the KV cache)")
    return blocks
