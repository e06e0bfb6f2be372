"""A LoRA adapter for the tiny model (``tests/vllm_tiny_model.py``), made offline: random ``q_proj``/``v_proj``
weights in PEFT's safetensors layout, which a real vLLM loads through ``/v1/load_lora_adapter``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

RANK = 8
HIDDEN, Q_DIM, KV_DIM, LAYERS = 256, 256, 128, 2
"""The tiny model's shape."""


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors layout: an 8-byte little-endian header length, a JSON header, the raw tensors."""
    header: dict[str, object] = {}
    offset, blobs = 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def make_adapter(directory: Path, base_model: str, rank: int = RANK) -> Path:
    """An adapter for the tiny model: random ``q_proj``/``v_proj`` weights of ``rank`` in PEFT's layout."""
    rng = np.random.default_rng(rank)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", Q_DIM), ("v_proj", KV_DIM)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, HIDDEN))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (out, rank))
    write_safetensors(directory / "adapter_model.safetensors", tensors)
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": base_model, "inference_mode": True}))
    return directory
