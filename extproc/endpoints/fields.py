"""Field checks and measures the endpoint parsers share: ``model``, ``stream``, text of contents, and the
facts they all return."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from extproc.endpoints.cost import EndpointCost
from extproc.errors import ApiError, invalid_request
from extproc.request import RequestFacts, RequestHead


def model_of(value: Any) -> str | ApiError:
    """The model a request names: required here even where vLLM makes it optional, because a fleet of several
    models cannot route a request that names none."""
    if value is None:
        return invalid_request("You must provide a model parameter.", "model", "missing_model")
    if not isinstance(value, str) or not value:
        return invalid_request("'model' must be a non-empty string.", "model", "invalid_type")
    return value


def flag_of(data: dict[str, Any], name: str) -> bool | ApiError:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        return invalid_request(f"'{name}' must be a boolean.", name, "invalid_type")
    return bool(value)


def positive_int(data: dict[str, Any], name: str) -> int | ApiError | None:
    value = data.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        return invalid_request(f"'{name}' must be a positive integer.", name, "invalid_type")
    return int(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def content_texts(content: Any) -> list[str]:
    """The texts of a message's content: a string, or the ``text`` of each part (other parts hold none)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []


def facts(head: RequestHead, model: str, parts: Iterable[str], cost: EndpointCost, *, token_ids: int = 0,
          stream: bool = False, max_tokens: int | None = None, messages: int = 0, session_id: str = "",
          include_usage: bool = False) -> RequestFacts:
    texts = tuple(parts)
    return RequestFacts(
        path=head.path, method=head.method, model=model, stream=stream, max_tokens=max_tokens,
        prompt_chars=sum(map(len, texts)), prompt_token_ids=token_ids, message_count=messages,
        client_routing_headers=head.client_routing_headers, request_id=head.request_id, prompt_parts=texts,
        session_id=head.session_id or session_id, include_usage=include_usage, cost=cost,
    )
