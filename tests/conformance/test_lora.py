"""LoRA adapters loaded and unloaded at run time through the worker's API (what the controller does for the
catalogue's adapters), held against the simulated worker and a real vLLM with an adapter made offline for the
tiny model (random ``q_proj``/``v_proj`` weights in PEFT's safetensors layout).

The package's engines are started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; each test
unloads what it loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.conftest import MODEL, Engine
from tests.tiny_lora import RANK, make_adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("tiny-lora"), MODEL)


def test_load_serve_list_unload(engine: Engine, adapter: Path) -> None:
    """Before loading, the adapter's name is an unknown model (404); loaded, it serves under its own name and
    is listed with the base model as its parent; unloaded, it is unknown again."""
    name = f"sql-{engine.name}"
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


def test_loading_a_loaded_name_again_is_400(engine: Engine, adapter: Path) -> None:
    name = f"twice-{engine.name}"
    assert engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)}).status_code \
        == 200
    again = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
    assert again.status_code == 400
    assert engine.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_unloading_an_unknown_adapter_is_an_error(engine: Engine) -> None:
    answer = engine.post("/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert answer.status_code in (400, 404), answer.text


def test_an_adapter_of_a_rank_above_the_limit_is_refused(engine: Engine,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--max-lora-rank`` is a hard limit: the load fails with an error that names both ranks, the name stays
    unknown, and the engine goes on serving."""
    too_wide = make_adapter(tmp_path_factory.mktemp("wide-lora"), MODEL, rank=2 * RANK)
    name = f"wide-{engine.name}"
    answer = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(too_wide)})
    assert answer.status_code >= 400 and f"LoRA rank {2 * RANK} is greater than max_lora_rank {RANK}" in answer.text, \
        (answer.status_code, answer.text)
    assert name not in {card["id"] for card in engine.get("/v1/models").json()["data"]}
    served = engine.post("/v1/completions", {"model": MODEL, "prompt": "select", "max_tokens": 2})
    assert served.status_code == 200, served.text
