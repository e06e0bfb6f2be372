"""``POST /v1/chat/completions``: the prompt is ``messages``, each content a string or an array of parts."""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured
from extproc.errors import ApiError, invalid_request

CHAT_PATH = "/v1/chat/completions"


def measure_messages(data: dict[str, Any]) -> Measured | ApiError:
    messages = data.get("messages")
    if messages is None:
        return invalid_request("You must provide a 'messages' parameter.", "messages", "missing_messages")
    if not isinstance(messages, list) or not messages:
        return invalid_request("'messages' must be a non-empty array.", "messages", "invalid_type")
    chars = 0
    parts: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return invalid_request(f"'messages.{index}' must be an object.", f"messages.{index}", "invalid_type")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    return invalid_request(f"'messages.{index}.content' parts must be objects.",
                                           f"messages.{index}.content", "invalid_type")
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
                    parts.append(text)
        elif content is not None:
            return invalid_request(f"'messages.{index}.content' must be a string, an array or null.",
                                   f"messages.{index}.content", "invalid_type")
    return Measured(chars, 0, len(messages), tuple(parts))


ENDPOINT = Endpoint(CHAT_PATH, "chat", measure_messages, chat_template=True)
