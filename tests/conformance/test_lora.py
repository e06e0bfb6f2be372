"""LoRA adapters loaded and unloaded at run time through the worker's API (what the controller does for the
catalogue's adapters), held against the simulated worker and a real vLLM with an adapter made offline for the
tiny model (random ``q_proj``/``v_proj`` weights in PEFT's safetensors layout).

Module-scoped engines started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conformance.conftest import MODEL, Engine, _sim, _vllm

RANK = 8
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK))
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
HIDDEN, Q_DIM, KV_DIM, LAYERS = 256, 256, 128, 2
"""The tiny model's shape (tests/vllm_tiny_model.py)."""


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


def make_adapter(directory: Path, rank: int = RANK) -> Path:
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
        "base_model_name_or_path": MODEL, "inference_mode": True}))
    return directory


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("tiny-lora"))


@pytest.fixture(scope="module")
def sim_lora_engine() -> Iterator[Engine]:
    with _sim(MODEL, LORA_ARGS, LORA_ENV) as engine:
        yield engine


@pytest.fixture(scope="module")
def vllm_lora_engine() -> Iterator[Engine]:
    with _vllm(MODEL, LORA_ARGS, LORA_ENV) as engine:
        yield engine


@pytest.fixture(params=["sim", "vllm"])
def lora_engine(request: pytest.FixtureRequest) -> Engine:
    return request.getfixturevalue(f"{request.param}_lora_engine")  # type: ignore[no-any-return]


def test_load_serve_list_unload(lora_engine: Engine, adapter: Path) -> None:
    """Before loading, the adapter's name is an unknown model (404); loaded, it serves under its own name and
    is listed with the base model as its parent; unloaded, it is unknown again."""
    engine, name = lora_engine, f"sql-{lora_engine.name}"
    completion = {"model": name, "prompt": "select", "max_tokens": 3}
    assert engine.post("/v1/completions", completion).status_code == 404
    loaded = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    cards = {card["id"]: card for card in engine.get("/v1/models").json()["data"]}
    assert cards[name]["parent"] == MODEL and cards[MODEL]["parent"] is None
    body = engine.post("/v1/completions", completion).json()
    assert body["model"] == name and body["usage"]["completion_tokens"] <= 3
    assert engine.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert engine.post("/v1/completions", completion).status_code == 404


def test_loading_a_loaded_name_again_is_400(lora_engine: Engine, adapter: Path) -> None:
    name = f"twice-{lora_engine.name}"
    assert lora_engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)}).status_code \
        == 200
    again = lora_engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
    assert again.status_code == 400
    assert lora_engine.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_unloading_an_unknown_adapter_is_an_error(lora_engine: Engine) -> None:
    answer = lora_engine.post("/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert answer.status_code in (400, 404), answer.text


def test_an_adapter_of_a_rank_above_the_limit_is_refused(lora_engine: Engine,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--max-lora-rank`` is a hard limit: the load fails with an error that names both ranks, the name stays
    unknown, and the engine goes on serving."""
    too_wide = make_adapter(tmp_path_factory.mktemp("wide-lora"), rank=2 * RANK)
    name = f"wide-{lora_engine.name}"
    answer = lora_engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(too_wide)})
    assert answer.status_code >= 400 and f"LoRA rank {2 * RANK} is greater than max_lora_rank {RANK}" in answer.text, \
        (answer.status_code, answer.text)
    assert name not in {card["id"] for card in lora_engine.get("/v1/models").json()["data"]}
    served = lora_engine.post("/v1/completions", {"model": MODEL, "prompt": "select", "max_tokens": 2})
    assert served.status_code == 200, served.text
