"""The one request-path error type: a value that becomes an OpenAI-style JSON error answer.

Everything that can go wrong for one request (bad JSON, unknown model, no worker) is returned as an
``ApiError``, never raised through the gRPC stream. The exceptions extproc raises itself are
``PoolgateError``s: the stream's ``ProtocolError`` by way of ``ExtprocError``, a worker's KV events that do
not decode as an ``UpstreamError``. ``answers.error_answer`` is the one place that turns an ``ApiError``
into Envoy's ImmediateResponse, so every error a client sees has the same shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from poolgate.kernel.errors import PoolgateError


class ExtprocError(PoolgateError):
    """Base of the exceptions extproc raises itself (a request's own mistakes are ``ApiError`` values)."""


class ProtocolError(ExtprocError):
    """Envoy sent a message the stream does not expect now (answered 500, never a crash)."""


@dataclass(frozen=True, slots=True)
class ApiError:
    status: int
    """HTTP status code of the answer."""
    message: str
    type: str
    """OpenAI error type, e.g. ``invalid_request_error``."""
    code: str | None = None
    """Machine-readable reason, e.g. ``model_not_found``."""
    param: str | None = None
    """Request field at fault, e.g. ``model``."""
    retry_after_s: int | None = None
    """Sent as ``Retry-After`` when the client should simply try again later."""

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


def invalid_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model {model!r} does not exist or is not served here.", "invalid_request_error",
                    "model_not_found", "model")


def endpoint_not_served(model: str, task: str, path: str) -> ApiError:
    """The model's kind does not serve this endpoint (embeddings of a chat model): vLLM's refusal, before routing."""
    return ApiError(400, f"The model {model!r} is a {task!r} model and does not serve {path}.",
                    "invalid_request_error", "unsupported_endpoint", "model")


def unknown_path(method: str, path: str) -> ApiError:
    """OpenAI's answer to a path or method it does not serve."""
    return ApiError(404, f"Invalid URL ({method} {path})", "invalid_request_error", "unknown_url")


def body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"Request body of {size} bytes exceeds the limit of {limit} bytes.",
                    "invalid_request_error", "request_too_large")


def context_too_long(model: str, needed: int, limit: int) -> ApiError:
    return ApiError(400, f"The request needs at least {needed} tokens but {model!r} accepts at most {limit}.",
                    "invalid_request_error", "context_length_exceeded", "messages")


def no_worker(model: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, f"No worker serving {model!r} is ready; retry shortly.", "service_unavailable",
                    "no_ready_worker", retry_after_s=retry_after_s)


def cold_start_timeout(model: str, waited_s: float, retry_after_s: int) -> ApiError:
    """A pool scaled to zero did not get a Ready worker within its cold-start wait (``cold_start_wait_s``)."""
    return ApiError(503, f"No worker serving {model!r} became ready within the cold-start wait (waited "
                    f"{waited_s:.1f} s while one starts); retry after {retry_after_s} s.", "service_unavailable",
                    "cold_start_timeout", retry_after_s=retry_after_s)


def no_capacity(model: str, waited_s: float, retry_after_s: int = 1) -> ApiError:
    return ApiError(429, f"Every worker serving {model!r} is at capacity (waited {waited_s:.1f} s); retry after "
                    f"{retry_after_s} s.", "rate_limit_error", "no_capacity", retry_after_s=retry_after_s)


def invalid_api_key(given: bool) -> ApiError:
    message = ("Incorrect API key provided." if given else
               "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    return ApiError(401, message, "invalid_request_error", "invalid_api_key")


def unknown_tenant() -> ApiError:
    return ApiError(401, "The tenant named by the ingress is not configured.", "invalid_request_error",
                    "invalid_api_key")


def model_not_allowed(model: str) -> ApiError:
    return ApiError(403, f"Your API key may not use the model {model!r}.", "invalid_request_error",
                    "model_not_allowed", "model")


def quota_exceeded(tenant: str, limit: str, value: int, retry_after_s: int) -> ApiError:
    """429 naming the limit (``param``): ``max_concurrent``, ``requests_per_minute`` or ``tokens_per_minute``."""
    return ApiError(429, f"Tenant {tenant!r} is over its {limit} limit of {value}; retry after {retry_after_s} s.",
                    "rate_limit_error", "rate_limit_exceeded", limit, retry_after_s)


def request_over_quota(tenant: str, needed: int, value: int) -> ApiError:
    """The request alone needs more tokens than a minute allows: retrying never helps."""
    return ApiError(429, f"The request needs about {needed} tokens but tenant {tenant!r} may use {value} per "
                    "minute; lower max_tokens or the prompt.", "rate_limit_error", "tokens_exceed_limit",
                    "tokens_per_minute")


def queue_full(model: str, retry_after_s: int) -> ApiError:
    return ApiError(429, f"Too many requests are waiting for {model!r}; retry after {retry_after_s} s.",
                    "rate_limit_error", "queue_full", retry_after_s=retry_after_s)


def quota_unavailable() -> ApiError:
    return ApiError(503, "The quota store is unreachable; retry shortly.", "service_unavailable",
                    "quota_unavailable", retry_after_s=1)


def internal_error() -> ApiError:
    return ApiError(500, "The router failed to process the request.", "internal_error", "internal_error")
