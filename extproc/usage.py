"""Reads the token usage a worker reports in its response body: tenants charged by tokens per minute and the
GenAI token-usage metric use it.

A non-streaming answer carries ``usage`` in its JSON body; a stream carries it in a last chunk
(``"choices": []`` plus ``usage``) only when the request asked for ``stream_options.include_usage``. extproc
asks for it on behalf of clients that did not, and then removes that chunk from what they receive, so their
stream looks exactly as they asked. Envoy sends the response body in chunks (``STREAMED``); an SSE event may
be split across chunks, so complete events are passed on and a partial one is kept for the next chunk.
Chunks are only searched for bytes, never JSON-parsed, unless they hold a usage object (``"usage":{``): a
stream's usage is parsed once, at its last chunk.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_BODY_BYTES = 4 * 1024 * 1024
"""A non-streaming answer longer than this is not parsed (its usage stays the admission estimate)."""
_EVENT_END = b"\n\n"


class UsageWatch:
    """One response's observer: ``feed`` each body chunk; ``total_tokens`` once the usage was seen, and
    ``input_tokens`` / ``output_tokens`` when it named them (``prompt_tokens`` / ``completion_tokens``)."""

    __slots__ = ("_buffer", "_overflow", "hide_usage_chunk", "input_tokens", "output_tokens", "stream",
                 "total_tokens")

    def __init__(self, stream: bool, hide_usage_chunk: bool = False) -> None:
        self.stream = stream
        self.hide_usage_chunk = hide_usage_chunk and stream
        self.total_tokens: int | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self._buffer = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """The bytes to send on instead of ``chunk``, or None to send it unchanged."""
        if not self.stream:
            self._collect(chunk)
            if end_of_stream and not self._overflow:
                self._read_usage(bytes(self._buffer))
                self._buffer.clear()
            return None
        if not self.hide_usage_chunk:
            self._scan(chunk, end_of_stream)
            return None
        return self._rewrite(chunk, end_of_stream)

    def _collect(self, chunk: bytes) -> None:
        if self._overflow or len(self._buffer) + len(chunk) > MAX_BODY_BYTES:
            self._overflow = True
            self._buffer.clear()
            return
        self._buffer += chunk

    def _scan(self, chunk: bytes, end_of_stream: bool) -> None:
        """Observe only: look at complete events, keep a partial tail."""
        if self._passes_whole(chunk):
            return
        complete = self._complete_events(chunk, end_of_stream)
        if complete is None:
            if len(self._buffer) > MAX_BODY_BYTES:
                self._buffer.clear()
            return
        if _may_report_usage(complete):
            for event in complete.split(_EVENT_END):
                self._event_usage(event)

    def _rewrite(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        if self._passes_whole(chunk):
            return None
        fresh = not self._buffer
        complete = self._complete_events(chunk, end_of_stream)
        if complete is None:
            return b""  # no complete event yet: send nothing now, the bytes follow with the next chunk
        if b'"usage"' not in complete:
            return complete
        events = complete.split(_EVENT_END)
        kept = [event for event in events if not self._is_usage_chunk(event)]
        if fresh and len(kept) == len(events) and complete == chunk:
            return None
        return _EVENT_END.join(kept)

    def _passes_whole(self, chunk: bytes) -> bool:
        """The common case: whole events, no usage object (``"usage":null`` on every chunk is none)."""
        return not self._buffer and chunk.endswith(_EVENT_END) and not _may_report_usage(chunk)

    def _complete_events(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """Buffer ``chunk`` and take the complete events out (everything at the stream's end); None when no
        event is complete yet."""
        buffer = self._buffer
        buffer += chunk
        cut = len(buffer) if end_of_stream else buffer.rfind(_EVENT_END) + len(_EVENT_END)
        if cut < len(_EVENT_END) and not end_of_stream:
            return None
        complete = bytes(buffer[:cut])
        del buffer[:cut]
        return complete

    def _is_usage_chunk(self, event: bytes) -> bool:
        data = self._event_usage(event)
        return data is not None and not data.get("choices")

    def _event_usage(self, event: bytes) -> dict[str, Any] | None:
        """The event's JSON when it reports usage (and note the usage), else None."""
        text = event.strip()
        if not text.startswith(b"data:") or b'"usage"' not in text:
            return None
        try:
            data = orjson.loads(text[5:])
        except orjson.JSONDecodeError:
            return None
        if isinstance(data, dict) and self._note(data.get("usage")):
            return data
        return None

    def _read_usage(self, body: bytes) -> None:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(data, dict):
            self._note(data.get("usage"))

    def _note(self, usage: Any) -> bool:
        if not isinstance(usage, dict):
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            self.input_tokens, self.output_tokens = prompt, completion
        total = usage.get("total_tokens")
        if isinstance(total, int):
            self.total_tokens = total
        elif self.input_tokens is not None and self.output_tokens is not None:
            self.total_tokens = self.input_tokens + self.output_tokens
        else:
            return False
        return True


def _may_report_usage(chunk: bytes) -> bool:
    return b'"usage":{' in chunk or b'"usage": {' in chunk


def with_usage_requested(body: bytes) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None when it cannot be rewritten."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    options = data.get("stream_options")
    data["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return orjson.dumps(data)
