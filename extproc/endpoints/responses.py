"""``POST /v1/responses``: the Responses API, what current OpenAI SDKs and agent frameworks call by default.

``input`` is a string (one user message) or a list of items: messages (``role`` plus a string or a list of
``input_text`` / ``output_text`` parts), ``function_call`` (its name and arguments are prompt text),
``function_call_output`` (its output), ``reasoning`` (its summary) and items without text (images, tool
calls of other kinds), which count as messages of the template. ``instructions`` is one more (system) message.
Cost as for chat: the text estimate plus ``MESSAGE_OVERHEAD_TOKENS`` per item and ``REPLY_PRIMING_TOKENS``;
output room ``max_output_tokens`` or the default. A stream always ends with its usage (``response.completed``),
so nothing has to be asked on the client's behalf. A ``previous_response_id`` continues a conversation stored
on the worker that answered it; its text is not in the request, so the estimate cannot include it.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.cost import EndpointCost
from extproc.endpoints.fields import content_texts, facts, flag_of, model_of, positive_int
from extproc.errors import ApiError, invalid_request
from extproc.request import RequestFacts, RequestHead
from extproc.scheduling.estimate import MESSAGE_OVERHEAD_TOKENS, REPLY_PRIMING_TOKENS


def parse_responses(head: RequestHead, data: dict[str, Any]) -> RequestFacts | ApiError:
    model = model_of(data.get("model"))
    if isinstance(model, ApiError):
        return model
    items = input_texts(data.get("input"))
    if isinstance(items, ApiError):
        return items
    count, parts = items
    instructions = data.get("instructions")
    if isinstance(instructions, str) and instructions:
        count, parts = count + 1, [instructions, *parts]
    elif instructions is not None and not isinstance(instructions, str):
        return invalid_request("'instructions' must be a string.", "instructions", "invalid_type")
    stream = flag_of(data, "stream")
    if isinstance(stream, ApiError):
        return stream
    max_tokens = positive_int(data, "max_output_tokens")
    if isinstance(max_tokens, ApiError):
        return max_tokens
    cost = EndpointCost(template_tokens=count * MESSAGE_OVERHEAD_TOKENS + REPLY_PRIMING_TOKENS,
                        longest_chars=sum(map(len, parts)))
    return facts(head, model, parts, cost, stream=stream, max_tokens=max_tokens, messages=count,
                 session_id=_session(data), include_usage=stream)


def input_texts(value: Any) -> tuple[int, list[str]] | ApiError:
    """(items, text pieces) of ``input``."""
    if isinstance(value, str):
        return 1, [value]
    if value is None:
        return invalid_request("You must provide an 'input' parameter.", "input", "missing_input")
    if not isinstance(value, list) or not value:
        return invalid_request("'input' must be a string or a non-empty array of items.", "input", "invalid_type")
    parts: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            return invalid_request(f"'input.{index}' must be an object.", f"input.{index}", "invalid_type")
        parts.extend(_item_texts(item))
    return len(value), parts


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


def _session(data: dict[str, Any]) -> str:
    """The body's session hint: ``prompt_cache_key`` (the Responses API's own), else ``user``."""
    for name in ("prompt_cache_key", "user"):
        value = data.get(name)
        if isinstance(value, str) and value:
            return value
    return ""
