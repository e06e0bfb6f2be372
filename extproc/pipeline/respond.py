"""The respond stage: what happens to a placed request's response on its way back to the client.

Each request gets a ``ResponseFeed``: two rewriters in a fixed order (the usage watch, which may hide the
usage chunk extproc asked for on the client's behalf, then the model renamer, which restores the public
name) and a list of observers that see the worker's bytes as they came (the GenAI metrics). An observer
records once: at the response's end, at extproc's own error answer, or when the stream closes first.
"""

from __future__ import annotations

from typing import Protocol

from extproc.catalogue import Route
from extproc.genai import GenAiCall
from extproc.metrics import Metrics
from extproc.rename import ModelRenamer
from extproc.request import RequestFacts, RequestHead
from extproc.scheduling import PickRequest
from extproc.usage import UsageWatch, with_usage_requested


class ResponseObserver(Protocol):
    """Watches one request without changing it; ``record`` is called whenever it may be complete."""

    @property
    def ended(self) -> bool: ...

    def resolved(self, facts: RequestFacts, model_known: bool) -> None: ...

    def placed(self, request: PickRequest) -> None: ...

    def refused(self, code: str, now: float) -> None: ...

    def response_headers(self, status: int | None, end_of_stream: bool, now: float) -> None: ...

    def response_chunk(self, chunk: bytes, end_of_stream: bool, now: float) -> None: ...

    def record(self, usage: UsageWatch | None, now: float) -> None: ...


class GenAiObserver:
    """The OpenTelemetry GenAI metrics of one inference request (see ``genai``), recorded once."""

    __slots__ = ("_call", "_metrics", "_recorded")

    def __init__(self, call: GenAiCall, metrics: Metrics) -> None:
        self._call = call
        self._metrics = metrics
        self._recorded = False

    @property
    def ended(self) -> bool:
        return self._call.ended

    def resolved(self, facts: RequestFacts, model_known: bool) -> None:
        call = self._call
        call.stream = facts.stream
        call.request_model = facts.model
        call.model_known = model_known

    def placed(self, request: PickRequest) -> None:
        self._call.model_known = True  # placed: a worker serves it
        self._call.response_model = request.adapter or request.model

    def refused(self, code: str, now: float) -> None:
        self._call.refused(code, now)

    def response_headers(self, status: int | None, end_of_stream: bool, now: float) -> None:
        self._call.response_headers(status, end_of_stream, now)

    def response_chunk(self, chunk: bytes, end_of_stream: bool, now: float) -> None:
        self._call.response_chunk(chunk, end_of_stream, now)

    def record(self, usage: UsageWatch | None, now: float) -> None:
        if self._recorded:
            return
        self._recorded = True
        self._call.record(self._metrics, usage.input_tokens if usage is not None else None,
                          usage.output_tokens if usage is not None else None, now)


class ResponseFeed:
    """One request's response path: the rewriters in order, then the observers."""

    __slots__ = ("observers", "renamer", "usage")

    def __init__(self) -> None:
        self.observers: tuple[ResponseObserver, ...] = ()
        self.usage: UsageWatch | None = None
        """Reads the usage the worker reports (quota reconciliation, GenAI token usage)."""
        self.renamer: ModelRenamer | None = None
        """Restores the public model name in the response body."""

    def resolved(self, facts: RequestFacts, model_known: bool) -> None:
        for observer in self.observers:
            observer.resolved(facts, model_known)

    def placed(self, request: PickRequest) -> None:
        for observer in self.observers:
            observer.placed(request)

    def refused(self, code: str, now: float) -> None:
        """extproc answered an error itself: observers record now."""
        for observer in self.observers:
            observer.refused(code, now)
            observer.record(self.usage, now)

    def headers(self, status: int | None, end_of_stream: bool, now: float) -> None:
        for observer in self.observers:
            observer.response_headers(status, end_of_stream, now)
            if end_of_stream:
                observer.record(self.usage, now)

    def chunk(self, chunk: bytes, end_of_stream: bool, now: float) -> bytes | None:
        """The bytes to send on instead of ``chunk``, or None to send it unchanged."""
        for observer in self.observers:
            observer.response_chunk(chunk, end_of_stream, now)
        usage, renamer = self.usage, self.renamer
        replacement = usage.feed(chunk, end_of_stream) if usage is not None else None
        if renamer is not None:
            renamed = renamer.feed(chunk if replacement is None else replacement, end_of_stream)
            replacement = renamed if renamed is not None else replacement
        for observer in self.observers:
            if end_of_stream or observer.ended:  # at the last byte or [DONE], with the usage it carried
                observer.record(usage, now)
        return replacement

    def close(self, now: float) -> None:
        """The stream closed: observers still waiting for the response's end record what they have."""
        for observer in self.observers:
            observer.record(self.usage, now)


class Respond:
    """Sets up each request's response feed."""

    def __init__(self, metrics: Metrics, genai_metrics: bool = False) -> None:
        self._metrics = metrics
        self.genai_metrics = genai_metrics
        """Watch every inference response (status and body) for the GenAI metrics (``observability``)."""

    def arrived(self, feed: ResponseFeed, head: RequestHead, now: float) -> None:
        if self.genai_metrics and head.is_inference:
            feed.observers = (GenAiObserver(GenAiCall(head.path, now), self._metrics),)

    @staticmethod
    def watch_usage(feed: ResponseFeed, facts: RequestFacts, body: bytes | None, raw: bytes) -> bytes | None:
        """Read the response's usage; a stream that did not ask for its usage chunk is sent upstream asking
        for it (the chunk is then hidden from the client). Returns the body to send when it changed."""
        hide = facts.stream and not facts.include_usage
        if hide:
            body = with_usage_requested(body or raw) or body
        feed.usage = UsageWatch(facts.stream, hide_usage_chunk=hide and body is not None)
        return body

    @staticmethod
    def rename(feed: ResponseFeed, route: Route) -> None:
        feed.renamer = ModelRenamer(route.served_name, route.public_name)
