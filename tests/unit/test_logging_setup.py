"""``--log-format``: JSON lines carry the request id of the task that logged them; text lines show it too."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from poolgate.kernel.logging_setup import JsonFormatter, RequestIdFilter, TextFormatter, configure_logging, request_id


def _line(formatter: logging.Formatter, rid: str | None) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger("poolgate.test.logging")
    logger.addHandler(handler)
    logger.propagate = False
    token = request_id.set(rid)
    try:
        logger.warning("picked %s", "w1")
    finally:
        request_id.reset(token)
        logger.removeHandler(handler)
    return stream.getvalue().strip()


@pytest.mark.parametrize("rid", ["req-1", None])
def test_json_lines_carry_the_request_id(rid: str | None) -> None:
    entry = orjson.loads(_line(JsonFormatter(), rid))
    assert entry["message"] == "picked w1" and entry["level"] == "WARNING"
    assert entry["logger"] == "poolgate.test.logging" and entry["time"].endswith("Z")
    assert entry.get("request_id") == rid


def test_text_lines_name_the_request() -> None:
    assert "poolgate.test.logging [req-2]: picked w1" in _line(TextFormatter(), "req-2")
    assert "poolgate.test.logging: picked w1" in _line(TextFormatter(), None)


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="json"):
        configure_logging("INFO", "xml")  # type: ignore[arg-type]
