"""The fleet client's answer parser: an answer cut anywhere waits for the rest, sized and chunked bodies come
back whole, and what is not HTTP or too large is an error rather than a wrong answer."""

from __future__ import annotations

import pytest

from poolgate.kernel.lean_http import MAX_HEAD_BYTES, AnswerTooLarge, parse_answer

SIZED = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"4\r\n{\"ok\r\n7;ext=1\r\n\":true}\r\n0\r\n\r\n")


@pytest.mark.parametrize("answer", [SIZED, CHUNKED])
def test_an_answer_cut_anywhere_waits_for_the_rest_then_comes_back_whole(answer: bytes) -> None:
    for cut in range(len(answer)):
        assert parse_answer(answer[:cut], 1024) is None, cut
    assert parse_answer(answer, 1024) == ((200, b'{"ok":true}', True), len(answer))


def test_headers_are_read_whatever_their_case_and_close_is_noticed() -> None:
    answer = b"HTTP/1.1 503 Service Unavailable\r\nCONNECTION: Close\r\ncontent-LENGTH: 2\r\n\r\nnoEXTRA"
    assert parse_answer(answer, 1024) == ((503, b"no", False), len(answer) - len(b"EXTRA"))


def test_no_length_is_an_empty_body() -> None:
    assert parse_answer(b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n", 1024) == ((204, b"", True), 38)


@pytest.mark.parametrize("answer", [SIZED, CHUNKED])
def test_a_body_larger_than_accepted_is_refused(answer: bytes) -> None:
    with pytest.raises(AnswerTooLarge):
        parse_answer(answer, 5)


@pytest.mark.parametrize("garbage", [b"SSH-2.0-OpenSSH_9.2\r\n\r\n", b"HTTP/1.1 abc OK\r\n\r\n", b"\r\n\r\n"])
def test_what_is_not_an_http_answer_is_an_error(garbage: bytes) -> None:
    with pytest.raises(ValueError):
        parse_answer(garbage, 1024)


def test_a_head_that_never_ends_is_an_error_once_past_the_limit() -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"a" * MAX_HEAD_BYTES
    with pytest.raises(ValueError, match="head longer"):
        parse_answer(endless, 1024)
    assert parse_answer(endless[:MAX_HEAD_BYTES], 1024) is None
