"""Restores the public model name in a response body whose worker answered with the served name.

The body comes chunk by chunk (``STREAMED``): a JSON answer or an SSE stream of JSON events. Each chunk gets
a bytes replace of the exact field ``"model":"<served>"`` (and the ``"model": "<served>"`` spelling) by the
public name; no JSON is parsed. This is safe because an unescaped ``"`` cannot occur inside a JSON string, so
the byte sequence ``"model":"<served>"`` only ever is an object member named ``model`` with that exact value:
a generated text mentioning it would carry ``\\"model\\"`` instead. A field split across two chunks is
caught by holding back only the chunk's tail that could begin the field (an SSE event ends in ``\\n\\n``,
which never does, so streamed tokens are never delayed).
"""

from __future__ import annotations

import orjson


class ModelRenamer:
    """One response's rewriter: ``feed`` each body chunk, send on what it returns."""

    __slots__ = ("_patterns", "_replacements", "_tail")

    def __init__(self, served_name: str, public_name: str) -> None:
        served, public = orjson.dumps(served_name), orjson.dumps(public_name)
        self._patterns = (b'"model":' + served, b'"model": ' + served)
        self._replacements = (b'"model":' + public, b'"model": ' + public)
        self._tail = b""

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """The bytes to send instead of ``chunk``, or None to send it unchanged (the common no-op case)."""
        data = self._tail + chunk if self._tail else chunk
        self._tail = b""
        out = data
        for pattern, replacement in zip(self._patterns, self._replacements, strict=True):
            if pattern in out:
                out = out.replace(pattern, replacement)
        if not end_of_stream:
            keep = self._partial_tail(out)
            if keep:
                self._tail = out[-keep:]
                out = out[:-keep]
        return None if out is chunk else out

    def _partial_tail(self, data: bytes) -> int:
        """Length of the longest suffix of ``data`` that is a proper prefix of a pattern (0 when none)."""
        longest = len(self._patterns[1]) - 1
        start = data.find(b'"', max(0, len(data) - longest))
        while start != -1:  # earliest quote first: the longest candidate suffix
            suffix = data[start:]
            if any(p.startswith(suffix) for p in self._patterns):
                return len(data) - start
            start = data.find(b'"', start + 1)
        return 0
