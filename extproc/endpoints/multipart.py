"""A ``multipart/form-data`` parser (RFC 7578 over RFC 2046's multipart syntax), for the audio endpoints,
whose ``model`` is a form field beside the binary audio file.

The boundary comes from the ``content-type`` header's ``boundary`` parameter, quoted or not. A part runs from
the line after one delimiter (``--boundary`` at the start of the body or after CRLF) to the CRLF before the
next; the closing delimiter is ``--boundary--``. Part contents are taken as bytes and never decoded, so binary
parts may hold any byte, CRLF and dashes included: only CRLF followed by the full delimiter ends a part.
Each part needs ``Content-Disposition: form-data; name="…"`` (``filename`` for files).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.errors import ApiError, invalid_request

MAX_BOUNDARY = 200
"""RFC 2046 allows 70 characters; a little slack for clients that exceed it."""
_CRLF = b"\r\n"


@dataclass(frozen=True, slots=True)
class FormPart:
    name: str
    filename: str | None
    content_type: str
    data: bytes
    headers: bytes = b""
    """The part's header block as sent (kept so a rewritten form keeps every part as it was)."""

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def header_parameters(value: str) -> tuple[str, dict[str, str]]:
    """``type; a=1; b="x;y"`` → (``type``, {a: 1, b: x;y}); names lower-cased, quoted strings unescaped."""
    params: dict[str, str] = {}
    segments: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in value:
        if escaped:
            current.append(char)
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
            current.append(char)
        elif char == ";" and not quoted:
            segments.append("".join(current))
            current = []
        else:
            current.append(char)
    segments.append("".join(current))
    main = segments[0].strip().lower()
    for segment in segments[1:]:
        name, sep, raw = segment.partition("=")
        if not sep:
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            raw = raw[1:-1]
        params[name.strip().lower()] = raw
    return main, params


def boundary_of(content_type: str) -> str | ApiError:
    kind, params = header_parameters(content_type)
    if kind != "multipart/form-data":
        return invalid_request("The request must be multipart/form-data (an audio 'file' and form fields).",
                               code="invalid_content_type")
    boundary = params.get("boundary", "")
    if not boundary or len(boundary) > MAX_BOUNDARY:
        return invalid_request("The multipart content-type has no valid boundary.", code="invalid_multipart")
    return boundary


def parse_form(body: bytes, content_type: str) -> tuple[FormPart, ...] | ApiError:
    boundary = boundary_of(content_type)
    if isinstance(boundary, ApiError):
        return boundary
    delimiter = b"--" + boundary.encode("latin-1", "replace")
    separator = _CRLF + delimiter
    if body.startswith(delimiter):
        position = 0
    else:
        found = body.find(separator)
        if found < 0:
            return _malformed("no part starts with the boundary")
        position = found + len(_CRLF)  # a preamble before the first delimiter is ignored
    parts: list[FormPart] = []
    while True:
        after = position + len(delimiter)
        if body[after:after + 2] == b"--":
            return tuple(parts)  # the closing delimiter; an epilogue after it is ignored
        line_end = body.find(_CRLF, after)
        if line_end < 0 or body[after:line_end].strip(b" \t"):
            return _malformed("a delimiter line has trailing characters")
        start = line_end + len(_CRLF)
        end = body.find(separator, start)
        if end < 0:
            return _malformed("the closing boundary is missing")
        part = _part(body[start:end])
        if isinstance(part, ApiError):
            return part
        parts.append(part)
        position = end + len(_CRLF)


def _part(raw: bytes) -> FormPart | ApiError:
    if raw.startswith(_CRLF):
        header_block, data = b"", raw[2:]
    else:
        cut = raw.find(_CRLF + _CRLF)
        if cut < 0:
            return _malformed("a part has no blank line after its headers")
        header_block, data = raw[:cut], raw[cut + 4:]
    disposition, content_type = "", "text/plain"
    for line in header_block.split(_CRLF):
        name, sep, value = line.decode("utf-8", "replace").partition(":")
        if not sep:
            return _malformed("a part header has no ':'")
        key = name.strip().lower()
        if key == "content-disposition":
            disposition = value
        elif key == "content-type":
            content_type = value.strip()
    kind, params = header_parameters(disposition)
    if kind != "form-data" or "name" not in params:
        return _malformed('a part lacks Content-Disposition: form-data; name="…"')
    return FormPart(params["name"], params.get("filename"), content_type, data, header_block)


def _malformed(why: str) -> ApiError:
    return invalid_request(f"The multipart body is malformed: {why}.", code="invalid_multipart")


def with_field(parts: tuple[FormPart, ...], content_type: str, name: str, value: str) -> bytes | ApiError:
    """The form again, with field ``name``'s value replaced (the catalogue renames ``model`` this way)."""
    boundary = boundary_of(content_type)
    if isinstance(boundary, ApiError):
        return boundary
    delimiter = b"--" + boundary.encode("latin-1", "replace")
    chunks = []
    for part in parts:
        data = value.encode() if part.name == name else part.data
        head = part.headers + _CRLF if part.headers else b""
        chunks.append(delimiter + _CRLF + head + _CRLF + data + _CRLF)
    chunks.append(delimiter + b"--" + _CRLF)
    return b"".join(chunks)


def form_data(parts: tuple[FormPart, ...]) -> dict[str, Any]:
    """A form as a request's data: each file part's bytes, each text field's value (``stream`` as the boolean
    the form spells ``true``/``false``), the first part of a name winning."""
    data: dict[str, Any] = {}
    for part in parts:
        if part.name in data:
            continue
        if part.filename is not None:
            data[part.name] = part.data
        elif part.name == "stream":
            data[part.name] = part.text().strip().lower() == "true"
        else:
            data[part.name] = part.text().strip()
    return data
