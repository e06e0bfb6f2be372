"""Errors: one JSON shape for every error, and the ImmediateResponse built from it in one place."""

from __future__ import annotations

import orjson
import pytest

from extproc import errors
from extproc.answers import error_answer
from extproc.errors import ApiError


@pytest.mark.parametrize(("error", "status", "code"), [
    (errors.invalid_request("bad", "model", "invalid_type"), 400, "invalid_type"),
    (errors.model_not_found("nope"), 404, "model_not_found"),
    (errors.body_too_large(10, 5), 413, "request_too_large"),
    (errors.context_too_long("m", 100, 50), 400, "context_length_exceeded"),
    (errors.no_worker("m", 2), 503, "no_ready_worker"),
    (errors.internal_error(), 500, "internal_error"),
])
def test_error_answer_is_openai_json(error: ApiError, status: int, code: str) -> None:
    answer = error_answer(error).immediate_response
    assert answer.status.code == status
    body = orjson.loads(answer.body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]
    headers = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    assert all(not h.header.value for h in answer.headers.set_headers)
    if status == 503:
        assert headers["retry-after"] == b"2"
    else:
        assert "retry-after" not in headers
