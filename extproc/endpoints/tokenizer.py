"""``/tokenize`` and ``/detokenize`` (vLLM serves them outside ``/v1``): the model's own tokenizer, run in the
worker's API server with no GPU work, so they are near-free (``FREE``: no prompt, no decode room) and only
need a worker of the named model. ``tokenize`` takes ``prompt`` or chat ``messages``; ``detokenize`` takes
``tokens``. vLLM lets a one-model server skip ``model``; a fleet cannot route without it, so it is required.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured, is_int
from extproc.endpoints.cost import FREE
from extproc.errors import ApiError, invalid_request
from poolgate.kernel.config import PoolTask

ANY_POOL: frozenset[PoolTask] = frozenset({"generate", "embed", "score", "transcription"})
NOTHING = Measured(0, 0, 0, (), FREE)


def measure_tokenize(data: dict[str, Any]) -> Measured | ApiError:
    if not isinstance(data.get("prompt"), str) and not isinstance(data.get("messages"), list):
        return invalid_request("You must provide a 'prompt' string or a 'messages' array.", "prompt",
                               "missing_prompt")
    return NOTHING


def measure_detokenize(data: dict[str, Any]) -> Measured | ApiError:
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        return invalid_request("'tokens' must be an array of token ids.", "tokens", "invalid_type")
    return NOTHING


TOKENIZE = Endpoint("/tokenize", "", measure_tokenize, pool_tasks=ANY_POOL)
DETOKENIZE = Endpoint("/detokenize", "", measure_detokenize, pool_tasks=ANY_POOL)
