"""The multipart/form-data parser: quoted boundaries, binary parts, and malformed bodies as 400s."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.endpoints.multipart import boundary_of, header_parameters, parse_form
from extproc.errors import ApiError

BOUNDARY_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'()+_,-./:=?"


def form(boundary: str, parts: list[tuple[str, bytes, str | None]], preamble: bytes = b"") -> bytes:
    chunks = [preamble]
    for name, data, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        chunks.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode())
        if filename:
            chunks.append(b"Content-Type: application/octet-stream\r\n")
        chunks.append(b"\r\n" + data + b"\r\n")
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks)


@pytest.mark.parametrize(("header", "boundary"), [
    ("multipart/form-data; boundary=abc123", "abc123"),
    ('multipart/form-data; boundary="with space; and semicolon"', "with space; and semicolon"),
    ('Multipart/Form-Data; charset=utf-8; BOUNDARY="q"', "q"),
    ("multipart/form-data;boundary=----WebKitFormBoundary7MA4YWxkTrZu0gW", "----WebKitFormBoundary7MA4YWxkTrZu0gW"),
])
def test_boundary_quoted_or_not(header: str, boundary: str) -> None:
    assert boundary_of(header) == boundary


@pytest.mark.parametrize("header", ["application/json", "multipart/form-data", 'multipart/form-data; boundary=""',
                                    "multipart/form-data; boundary=" + "x" * 201])
def test_bad_content_types_are_400(header: str) -> None:
    error = boundary_of(header)
    assert isinstance(error, ApiError) and error.status == 400


def test_header_parameters_unescape_quotes() -> None:
    assert header_parameters(r'form-data; name="a\"b"; filename="x;y.wav"') == (
        "form-data", {"name": 'a"b', "filename": "x;y.wav"})


def test_a_real_audio_form_with_a_quoted_boundary_and_preamble() -> None:
    boundary = "b; q"
    body = form(boundary, [("model", b"whisper", None), ("file", b"RIFF\r\n--b; \x00\xff", "a.wav")],
                preamble=b"ignored preamble\r\n")
    parts = parse_form(body, f'multipart/form-data; boundary="{boundary}"')
    assert not isinstance(parts, ApiError)
    assert [(p.name, p.filename, p.data) for p in parts] == [
        ("model", None, b"whisper"), ("file", "a.wav", b"RIFF\r\n--b; \x00\xff")]
    assert parts[1].content_type == "application/octet-stream"


@given(boundary=st.text(alphabet=BOUNDARY_CHARS, min_size=1, max_size=70),
       fields=st.lists(st.tuples(st.text(alphabet="abcdefgh_", min_size=1, max_size=10), st.binary(max_size=300),
                                 st.booleans()), max_size=5))
def test_any_binary_parts_round_trip(boundary: str, fields: list[tuple[str, bytes, bool]]) -> None:
    delimiter = b"\r\n--" + boundary.encode()
    parts = [(name, data, "f.bin" if is_file else None) for name, data, is_file in fields
             if delimiter not in b"\r\n" + data + b"\r\n"]  # a client picks a boundary its data lacks
    parsed = parse_form(form(boundary, parts), f'multipart/form-data; boundary="{boundary}"')
    assert not isinstance(parsed, ApiError)
    assert [(p.name, p.data, p.filename) for p in parsed] == parts


@pytest.mark.parametrize("body", [
    b"no boundary anywhere",
    b"--b\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\nvalue",  # never closed
    b"--b\r\nContent-Disposition: form-data; name=\"m\"\r\nvalue\r\n--b--",  # no blank line after headers
    b"--b\r\nContent-Disposition: attachment\r\n\r\nvalue\r\n--b--",  # not form-data
    b"--b\r\nno colon here\r\n\r\nvalue\r\n--b--",
    b"--bjunk\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\nv\r\n--b--",
])
def test_malformed_bodies_are_400(body: bytes) -> None:
    error = parse_form(body, "multipart/form-data; boundary=b")
    assert isinstance(error, ApiError) and (error.status, error.code) == (400, "invalid_multipart")
