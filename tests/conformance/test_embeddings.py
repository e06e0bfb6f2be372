"""An embedding model's worker (a pool with ``task: embed``), held against the simulated worker and a real vLLM
serving the tiny Llama as an embedding model: what extproc relies on to route and bill ``/v1/embeddings``.

Module-scoped engines: a second real vLLM lives only while this module runs.
"""

from __future__ import annotations

import pytest

from tests.conformance.conftest import Engine


def _vectors_ok(body: dict[str, object], count: int) -> None:
    assert body["object"] == "list"
    data = body["data"]
    assert isinstance(data, list) and [item["index"] for item in data] == list(range(count))
    assert {item["object"] for item in data} == {"embedding"}
    sizes = {len(item["embedding"]) for item in data}
    assert len(sizes) == 1 and sizes.pop() > 0
    assert all(isinstance(x, float) for x in data[0]["embedding"])


def test_embeddings_shape_and_usage(embed_engine: Engine) -> None:
    """Usage is prompt tokens only (no output): what extproc reconciles a quota with."""
    body = embed_engine.post("/v1/embeddings", {"model": embed_engine.model, "input": ["hello world", "second"]}).json()
    _vectors_ok(body, 2)
    assert body["model"] == embed_engine.model
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"]
    assert not usage.get("completion_tokens")


def test_embeddings_take_token_ids(embed_engine: Engine) -> None:
    body = embed_engine.post("/v1/embeddings", {"model": embed_engine.model, "input": [[11, 12, 13, 14]]}).json()
    _vectors_ok(body, 1)
    assert body["usage"]["prompt_tokens"] == 4


def test_the_model_is_listed_with_its_context(embed_engine: Engine) -> None:
    [model] = embed_engine.get("/v1/models").json()["data"]
    assert model["id"] == embed_engine.model and model["max_model_len"] == embed_engine.max_model_len


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_embedding_worker_does_not_generate(embed_engine: Engine, path: str) -> None:
    """poolgate refuses generation for an ``embed`` pool itself (400) before any worker is tried; a worker asked
    anyway does not answer 200."""
    answer = embed_engine.post(path, {"model": embed_engine.model, "prompt": "x", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code in (400, 404), answer.text
