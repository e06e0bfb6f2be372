"""``POST /v1/completions``: the prompt is a string, an array of strings, or token ids (flat or batched)."""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured, is_int
from extproc.errors import ApiError, invalid_request

COMPLETIONS_PATH = "/v1/completions"


def measure_prompt(data: dict[str, Any]) -> Measured | ApiError:
    prompt = data.get("prompt")
    if prompt is None:
        return invalid_request("You must provide a 'prompt' parameter.", "prompt", "missing_prompt")
    if isinstance(prompt, str):
        return Measured(len(prompt), 0, 0, (prompt,))
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return Measured(sum(len(p) for p in prompt), 0, 0, tuple(prompt))
        if all(is_int(p) for p in prompt):
            return Measured(0, len(prompt), 0, ())
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            return Measured(0, sum(len(p) for p in prompt), 0, ())
    return invalid_request("'prompt' must be a string, an array of strings or an array of token ids.",
                           "prompt", "invalid_type")


ENDPOINT = Endpoint(COMPLETIONS_PATH, "text_completion", measure_prompt)
