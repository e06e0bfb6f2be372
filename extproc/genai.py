"""One inference request as the OpenTelemetry GenAI metrics see it: its attributes and the moments that time it.

The servicer notes what it learns (the model asked for and the one that answers, the response status, each
response chunk's arrival, an error answer of its own) and calls ``record`` once: at the response's last byte,
at its own error answer, or when the stream closes before either. Times come from the servicer's injected
timer; nothing here does I/O.

What is measured, from extproc's seat between Envoy and the workers:

- request duration: request headers seen → last response byte (or extproc's own error answer). A request
  that ends in an error carries ``error_type``: extproc's error code (``no_capacity``, ``queue_full`` …),
  the worker's HTTP status (``500`` …), ``stream_error`` (a stream that had started failed: the worker's
  error event in it) or ``incomplete`` (the stream closed before the response's last byte: the client went
  away before the answer was whole, or the connection to the worker broke). A stream counts as whole at its
  ``[DONE]`` event, which a client may close on before the last byte.
- time to first token (streamed, succeeded): request headers seen → the first chunk carrying output. A
  worker may send an empty role-only event before any token (the simulated one does); a chunk counts once a
  content, text, reasoning or tool-call value in it is non-empty, found by a byte search, never a JSON parse,
  and only until the first one is found. It includes poolgate's queueing and holding.
- time per output token (streamed, succeeded, ≥ 2 output tokens): (last chunk − first output chunk) /
  (output tokens − 1). The last chunk is the usage/``[DONE]`` one, sent right after the last token.
- token usage (succeeded, usage reported): input and output tokens from the response's usage block.

A non-streamed answer arrives whole: its first byte is its last, so it has no time to first token or per
output token of its own (recording one would only copy its duration); it gets duration and token usage.
"""

from __future__ import annotations

import re

from extproc.endpoints import ENDPOINTS
from extproc.metrics import Metrics

PROVIDER_NAME = "openai"
"""``gen_ai.provider.name``: workers speak OpenAI's API, and the conventions use this attribute to name the
flavour of the telemetry (the API), not who runs the engine; the model attributes say what served it."""
OPERATIONS = {path: endpoint.operation for path, endpoint in ENDPOINTS.items()}
"""``gen_ai.operation.name`` by request path (the conventions' well-known values)."""
INCOMPLETE = "incomplete"
STREAM_ERROR = "stream_error"
"""``error_type`` of a stream that failed after its 200: vLLM then sends its error as an SSE event of its own
(``data: {"error": {...}}``, then ``[DONE]``)."""
_ERROR_EVENT = b'data: {"error"'
"""Generated text cannot match: inside an event's JSON its quotes are escaped."""
_DONE_EVENT = b"data: [DONE]"
"""The end of an OpenAI stream. A client may close as soon as it reads it (the openai SDK does), before the
response's last byte reaches Envoy: the answer was whole all the same."""
_OUTPUT = re.compile(rb'"(?:content|text|reasoning_content|reasoning)": ?"[^"]|"tool_calls": ?\[\{')
"""A non-empty generated value in an SSE event (``"content":""`` of a role-only event does not match)."""


class GenAiCall:
    """Attributes and timestamps of one inference request; ``record`` turns them into observations."""

    __slots__ = ("ended_at", "error_type", "first_output_at", "last_chunk_at", "model_known", "operation",
                 "request_model", "response_model", "started", "status", "stream")

    def __init__(self, path: str, started: float) -> None:
        self.operation = OPERATIONS.get(path, "")
        self.started = started
        self.request_model = ""
        """The model the client asked for (its public name)."""
        self.model_known = False
        """The catalogue or the fleet knows ``request_model``: only then is it a label value (a client's
        made-up names must not become series)."""
        self.response_model = ""
        """The name sent to the worker, which it answers with (a catalogue version's served name); set once
        placed."""
        self.stream = False
        self.status: int | None = None
        self.error_type: str | None = None
        self.first_output_at: float | None = None
        self.last_chunk_at: float | None = None
        self.ended_at: float | None = None

    def refused(self, code: str, now: float) -> None:
        """extproc answered an error itself (the first answer counts)."""
        if self.error_type is None:
            self.error_type = code
            self.ended_at = now

    def response_headers(self, status: int | None, end_of_stream: bool, now: float) -> None:
        self.status = status
        if end_of_stream:
            self.ended_at = now

    def response_chunk(self, chunk: bytes, end_of_stream: bool, now: float) -> None:
        """Per chunk: two stores, one byte search until the first output was seen and two for the error and
        end events (streams only)."""
        if chunk:
            self.last_chunk_at = now
            if self.first_output_at is None and self.stream and _OUTPUT.search(chunk) is not None:
                self.first_output_at = now
            if self.stream and self.error_type is None and _ERROR_EVENT in chunk:
                self.error_type = STREAM_ERROR
            if self.stream and _DONE_EVENT in chunk:
                self.ended_at = now
        if end_of_stream:
            self.ended_at = now

    @property
    def ended(self) -> bool:
        """The answer is complete (its last byte, or a stream's ``[DONE]``): ready to record."""
        return self.ended_at is not None

    def outcome(self) -> str:
        """``error_type``'s value: empty when the request succeeded."""
        if self.error_type is not None:
            return self.error_type
        if self.ended_at is None:
            return INCOMPLETE
        if self.status is not None and self.status >= 400:
            return str(self.status)
        return ""

    def record(self, metrics: Metrics, input_tokens: int | None, output_tokens: int | None, now: float) -> None:
        """Observe the request's histograms, once; ``now`` ends a request whose response never did."""
        labels = (self.operation, PROVIDER_NAME, self.request_model if self.model_known else "",
                  self.response_model)
        error = self.outcome()
        ended = self.ended_at if self.ended_at is not None else now
        metrics.request_duration.labels(*labels, error).observe(max(0.0, ended - self.started))
        if error:
            return
        if input_tokens is not None and output_tokens is not None:
            metrics.token_usage.labels(*labels, "input").observe(input_tokens)
            metrics.token_usage.labels(*labels, "output").observe(output_tokens)
        first = self.first_output_at
        if not self.stream or first is None:
            return
        metrics.time_to_first_token.labels(*labels).observe(first - self.started)
        last = self.last_chunk_at
        if output_tokens is not None and output_tokens > 1 and last is not None and last > first:
            metrics.time_per_output_token.labels(*labels).observe((last - first) / (output_tokens - 1))
