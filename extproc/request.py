"""What one request asks for, parsed from Envoy's header and body messages into small frozen values.

Pure functions only: the director hands in header pairs and body bytes, gets back a ``RequestHead``, a
``RequestFacts`` or an ``ApiError`` (a client mistake is a value, not an exception). Only the OpenAI
inference endpoints (``endpoints``) are routed; any other path passes through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.endpoints import ENDPOINTS
from extproc.endpoints.base import is_int
from extproc.errors import ApiError, invalid_request
from poolgate.kernel.routing import ROUTING_HEADERS

MODELS_PATH = "/v1/models"
SESSION_HEADER = "x-session-id"
_ROUTING_HEADERS = frozenset(ROUTING_HEADERS)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """Facts from the request headers, known before the body arrives."""

    method: str
    path: str
    """Path without the query string."""
    content_length: int | None
    client_routing_headers: tuple[str, ...] = ()
    """Routing headers the client sent (lower case); the answer removes them so a client cannot pin itself."""
    request_id: str = ""
    session_id: str = ""
    """``x-session-id``: requests of one session prefer the worker that holds their cached prefix."""
    authorization: str = ""
    tenant_claim: str = ""
    """The trusted tenant header's value (empty when no ingress is trusted or it is absent)."""

    @property
    def is_api(self) -> bool:
        """Paths that need an identity when API keys are required."""
        return self.path.startswith("/v1/")

    @property
    def is_inference(self) -> bool:
        return self.method == "POST" and self.path in ENDPOINTS

    @property
    def is_model_list(self) -> bool:
        return self.method == "GET" and self.path == MODELS_PATH


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the scheduler needs to know about one inference request."""

    path: str
    method: str
    model: str
    stream: bool = False
    max_tokens: int | None = None
    prompt_chars: int = 0
    """Characters of prompt text (message contents or prompt strings)."""
    prompt_token_ids: int = 0
    """Tokens given directly as ids (``prompt`` as a list of ints)."""
    message_count: int = 0
    client_routing_headers: tuple[str, ...] = ()
    request_id: str = ""
    prompt_parts: tuple[str, ...] = ()
    """The prompt's text pieces in order (message contents or prompt strings), for tokenizers and affinity."""
    session_id: str = ""
    """``x-session-id`` header, else the body's ``user`` field; empty when neither is given."""
    include_usage: bool = False
    """The client asked for the usage chunk of a stream (``stream_options.include_usage``)."""


def parse_head(headers: Iterable[tuple[str, str]], tenant_header: str | None = None,
               trust_tenant_header: bool = False) -> RequestHead:
    """``tenant_header``: the header an ingress may set; read when trusted, else stripped like a routing one."""
    method = path = request_id = session_id = authorization = claim = ""
    content_length: int | None = None
    routing: list[str] = []
    for raw_key, value in headers:
        key = raw_key.lower()
        if key == ":method":
            method = value.upper()
        elif key == ":path":
            path = value.split("?", 1)[0]
        elif key == "content-length":
            content_length = int(value) if value.isascii() and value.isdigit() else None  # not '²'
        elif key == "x-request-id":
            request_id = value
        elif key == SESSION_HEADER:
            session_id = value
        elif key == "authorization":
            authorization = value
        elif key in _ROUTING_HEADERS:
            routing.append(key)
        elif key == tenant_header:
            if trust_tenant_header:
                claim = value.strip()
            else:
                routing.append(key)
    return RequestHead(method, path, content_length, tuple(dict.fromkeys(routing)), request_id, session_id,
                       authorization, claim)


def load_body(body: bytes) -> dict[str, Any] | ApiError:
    """The body as a JSON object (the catalogue rewrites it in this form before it is dumped again)."""
    if not body:
        return invalid_request("The request body must be a JSON object.", code="missing_body")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return invalid_request(f"The request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        return invalid_request("The request body must be a JSON object.", code="invalid_json")
    return data


def facts_from_data(head: RequestHead, data: dict[str, Any]) -> RequestFacts | ApiError:
    """Validate an inference request body (``load_body``'s object) the way the OpenAI API does, keeping only
    what routing needs; the endpoint of ``head.path`` measures its prompt."""
    model = data.get("model")
    if model is None:
        return invalid_request("You must provide a model parameter.", "model", "missing_model")
    if not isinstance(model, str) or not model:
        return invalid_request("'model' must be a non-empty string.", "model", "invalid_type")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return invalid_request("'stream' must be a boolean.", "stream", "invalid_type")
    max_tokens: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = data.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            return invalid_request(f"'{name}' must be a positive integer.", name, "invalid_type")
        max_tokens = value if max_tokens is None else max_tokens
    prompt = ENDPOINTS[head.path].measure(data)
    if isinstance(prompt, ApiError):
        return prompt
    chars, token_ids, messages, parts = prompt
    options = data.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    user = data.get("user")
    session_id = head.session_id or (user if isinstance(user, str) else "")
    return RequestFacts(
        path=head.path, method=head.method, model=model, stream=bool(stream), max_tokens=max_tokens,
        prompt_chars=chars, prompt_token_ids=token_ids, message_count=messages,
        client_routing_headers=head.client_routing_headers, request_id=head.request_id,
        prompt_parts=parts, session_id=session_id, include_usage=include_usage,
    )
