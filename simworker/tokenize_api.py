"""``/tokenize`` and ``/detokenize`` as vLLM serves them (outside ``/v1``, on every kind of model).

They run in the API server, not the engine: no KV, no step, no fault counter. Token ids of the stand-in
tokenizer are stable hashes of its tokens into a Llama-3-sized vocabulary; detokenizing an id gives a filler
word chosen by the id (the stand-in tokenizer cannot be inverted, and nothing here needs it to be).
"""

from __future__ import annotations

from aiohttp import web

from simworker import tokens
from simworker.endpoint_steps import check_model
from simworker.protocol import WorkerApiError
from simworker.request_fields import content_text, json_object, model_field
from simworker.server import WorkerApi, _json, _read_json

VOCAB_SIZE = 128_256
SPECIAL_IDS = 256
"""Ids below this are the template's markers (``<|start|>`` and friends), like a real tokenizer's specials."""


def token_id(token: str) -> int:
    if token.startswith("<|"):
        return tokens.stable_hash(token) % SPECIAL_IDS
    return SPECIAL_IDS + tokens.stable_hash(token) % (VOCAB_SIZE - SPECIAL_IDS)


def tokenize_body(body: object, max_model_len: int) -> tuple[str | None, dict[str, object]]:
    """The requested model and vLLM's answer: ``count``, ``max_model_len``, ``tokens`` and ``token_strs``
    (only with ``return_token_strs``). Takes ``prompt`` or, rendered through the chat template, ``messages``."""
    fields = json_object(body)
    if "messages" in fields:
        messages = fields["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise WorkerApiError(400, "'messages' must be a list of messages", "messages")
        parts = [f"<|start|>{m.get('role', '')}<|sep|>{content_text(m.get('content'))}<|end|>" for m in messages]
        if fields.get("add_generation_prompt", True):
            parts.append("<|start|>assistant<|sep|>")
        text = "".join(parts)
    else:
        prompt = fields.get("prompt")
        if not isinstance(prompt, str):
            raise WorkerApiError(400, "'prompt' must be a string", "prompt")
        text = prompt
    found = tokens.tokenize(text)
    answer: dict[str, object] = {"count": len(found), "max_model_len": max_model_len,
                                 "tokens": [token_id(t) for t in found], "token_strs": None}
    if fields.get("return_token_strs") is True:
        answer["token_strs"] = found
    return model_field(fields), answer


def detokenize_body(body: object) -> tuple[str | None, dict[str, object]]:
    fields = json_object(body)
    ids = fields.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise WorkerApiError(400, "'tokens' must be a list of token ids", "tokens")
    for value in ids:
        if not 0 <= value < VOCAB_SIZE:
            raise WorkerApiError(400, f"token id {value} is out of vocabulary (size {VOCAB_SIZE})", "tokens")
    words = tokens.FILLER_WORDS
    return model_field(fields), {"prompt": "".join(" " + words[i % len(words)] for i in ids)}


def add_routes(app: web.Application, api: WorkerApi) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        model, answer = tokenize_body(await _read_json(request), api.config.max_model_len)
        check_model(api, model)
        return _json(answer)

    async def detokenize(request: web.Request) -> web.Response:
        model, answer = detokenize_body(await _read_json(request))
        check_model(api, model)
        return _json(answer)

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
