"""extproc tokenises a prompt as the engine does: its token ids equal the engine's own ``/tokenize`` for every
prompt shape, on both engines (the simulator's built-in tokenizer; for real vLLM the pool tokenizer over the tiny
model's directory, rendering its Jinja chat template).

A real vLLM showed the need: format strings standing in for the template tokenised one prompt in four
differently (the spaces at either end of a message, which the template trims). Block keys, the prefix-cache
lookup and the exact prompt count all rest on this equality.
"""

from __future__ import annotations

from typing import Any

import pytest

from extproc.kvcache.tokenizer import LocalTokenizer, PromptTokenizer, SimTokenizer, prompt_token_ids
from tests.conformance.conftest import Engine
from tests.real_vllm import TINY_MODEL

SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("system, user and assistant turns", {"messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]}),
    ("whitespace at either end", {"messages": [
        {"role": "system", "content": "  Answer in one word. "},
        {"role": "user", "content": "\n  Name a colour.\t\n"}]}),
    ("multi-part content", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"},
                                     {"type": "text", "text": "    return a + b  "}]}]}),
    ("no generation prompt", {"messages": [{"role": "user", "content": "Hi there"}],
                              "add_generation_prompt": False}),
    ("completion", {"prompt": "  Once upon a time, in a land far away "}),
]


def router_tokenizer(engine: Engine) -> PromptTokenizer:
    return SimTokenizer() if engine.name == "sim" else LocalTokenizer(str(TINY_MODEL))


@pytest.mark.parametrize(("shape", "body"), SHAPES, ids=[shape for shape, _ in SHAPES])
def test_the_router_makes_the_engines_token_ids(engine: Engine, shape: str, body: dict[str, Any]) -> None:
    if engine.name == "sim" and body.get("add_generation_prompt") is False:
        pytest.skip("the simulator's chat always primes the answer (its /tokenize honours the switch)")
    answer = engine.post("/tokenize", {"model": engine.model, **body})
    assert answer.status_code == 200, answer.text
    ours = prompt_token_ids({"model": engine.model, **body}, router_tokenizer(engine))
    assert ours is not None
    if engine.name == "sim":  # its /tokenize numbers tokens into a vocabulary, its KV events by a 32-bit hash
        assert len(ours) == answer.json()["count"]
    else:
        assert ours == answer.json()["tokens"]
