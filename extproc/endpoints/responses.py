"""``POST /v1/responses``: the Responses API, what current OpenAI SDKs and agent frameworks call by default.

``input`` is a string (one user message) or a list of items: messages (``role`` plus a string or a list of
``input_text`` / ``output_text`` parts), ``function_call`` (its name and arguments are prompt text),
``function_call_output`` (its output), ``reasoning`` (its summary) and items without text (images, tool
calls of other kinds), which still count as messages of the template. ``instructions`` is one more (system)
message. Cost as for chat: the text estimate plus the template's overhead per item; output room
``max_output_tokens`` or the default. A stream always ends with its usage (``response.completed``), so nothing
is asked on the client's behalf. A ``previous_response_id`` continues a conversation stored on the worker that
answered it; that text is not in the request, so the estimate cannot include it.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured, content_texts
from extproc.errors import ApiError, invalid_request

RESPONSES_PATH = "/v1/responses"


def measure_input(data: dict[str, Any]) -> Measured | ApiError:
    value = data.get("input")
    if value is None:
        return invalid_request("You must provide an 'input' parameter.", "input", "missing_input")
    if isinstance(value, str):
        count, parts = 1, [value]
    elif isinstance(value, list) and value:
        parts = []
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                return invalid_request(f"'input.{index}' must be an object.", f"input.{index}", "invalid_type")
            parts.extend(_item_texts(item))
        count = len(value)
    else:
        return invalid_request("'input' must be a string or a non-empty array of items.", "input", "invalid_type")
    instructions = data.get("instructions")
    if isinstance(instructions, str) and instructions:
        count, parts = count + 1, [instructions, *parts]
    elif instructions is not None and not isinstance(instructions, str):
        return invalid_request("'instructions' must be a string.", "instructions", "invalid_type")
    return Measured(sum(map(len, parts)), 0, count, tuple(parts))


def _item_texts(item: dict[str, Any]) -> list[str]:
    kind = item.get("type", "message")
    if kind == "message":
        return content_texts(item.get("content"))
    if kind == "function_call":
        return [text for text in (item.get("name"), item.get("arguments")) if isinstance(text, str)]
    if kind == "function_call_output":
        return content_texts(item.get("output"))
    if kind == "reasoning":
        return content_texts(item.get("summary"))
    return []


ENDPOINT = Endpoint(RESPONSES_PATH, "chat", measure_input, chat_template=True,
                    max_tokens_fields=("max_output_tokens",), usage_in_stream=True)
