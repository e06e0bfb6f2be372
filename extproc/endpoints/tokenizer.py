"""``/tokenize`` and ``/detokenize`` (vLLM serves them outside ``/v1``): the model's own tokenizer, run in the
worker's API server with no GPU work, so they are near-free (``FREE``: no prompt, no decode room) and only
need a worker of the named model. ``tokenize`` takes ``prompt`` or chat ``messages``; ``detokenize`` takes
``tokens``. vLLM lets a one-model server skip ``model``; a fleet cannot, so it is required here.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.cost import FREE
from extproc.endpoints.fields import facts, is_int, model_of
from extproc.errors import ApiError, invalid_request
from extproc.request import RequestFacts, RequestHead


def parse_tokenize(head: RequestHead, data: dict[str, Any]) -> RequestFacts | ApiError:
    model = model_of(data.get("model"))
    if isinstance(model, ApiError):
        return model
    if not isinstance(data.get("prompt"), str) and not isinstance(data.get("messages"), list):
        return invalid_request("You must provide a 'prompt' string or a 'messages' array.", "prompt",
                               "missing_prompt")
    return facts(head, model, (), FREE)


def parse_detokenize(head: RequestHead, data: dict[str, Any]) -> RequestFacts | ApiError:
    model = model_of(data.get("model"))
    if isinstance(model, ApiError):
        return model
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        return invalid_request("'tokens' must be an array of token ids.", "tokens", "invalid_type")
    return facts(head, model, (), FREE)
