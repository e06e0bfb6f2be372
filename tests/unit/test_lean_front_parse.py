"""The lean front's request parser: a request cut anywhere waits for the rest, then comes back whole with
its body and whether the client wants the connection closed."""

from __future__ import annotations

import pytest

from controller.lean_front import parse_request

REQUEST = b"POST /v1/heartbeats HTTP/1.1\r\nHost: x\r\nCONTENT-length: 2\r\n\r\n{}"


def test_a_request_cut_anywhere_waits_for_the_rest_then_comes_back_whole() -> None:
    for cut in range(len(REQUEST)):
        assert parse_request(bytearray(REQUEST[:cut])) is None, cut
    parsed = parse_request(bytearray(REQUEST + b"GET /healthz HTTP/1.1\r\n\r\n"))
    assert parsed is not None
    request, used = parsed
    assert (request.method, request.target, request.body, request.close, used) == (
        b"POST", b"/v1/heartbeats", b"{}", False, len(REQUEST))
    assert request.headers[b"host"] == b"x"


@pytest.mark.parametrize(("head", "close"), [
    (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", True), (b"GET / HTTP/1.0\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True), (b"GET / HTTP/1.1\r\n\r\n", False)])
def test_whether_the_client_wants_the_connection_closed(head: bytes, close: bool) -> None:
    parsed = parse_request(bytearray(head))
    assert parsed is not None and parsed[0].close is close
