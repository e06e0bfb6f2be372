"""The tenants benchmark's measurements: TTFT is the first generated text, and the TPM window is a minute."""

from __future__ import annotations

import orjson

from bench.tenants import Result, busiest_minute, read_event


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload)


def test_ttft_waits_for_generated_text_not_the_role_chunk() -> None:
    result = Result("gold", sent_at=0.0)
    read_event(result, event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 0.01)
    assert result.ttft_s is None
    read_event(result, event({"choices": [{"delta": {"content": "Hello"}}]}), 0.2)
    read_event(result, event({"choices": [{"delta": {"content": " there"}}]}), 0.3)
    assert result.ttft_s == 0.2


def test_usage_chunk_and_done_marker() -> None:
    result = Result("gold", sent_at=0.0)
    read_event(result, event({"choices": [], "usage": {"prompt_tokens": 208, "completion_tokens": 64,
                                                        "total_tokens": 272}}), 1.0)
    read_event(result, b"data: [DONE]", 1.0)
    assert result.total_tokens == 272 and result.ttft_s is None


def test_busiest_minute_slides_over_completions() -> None:
    results = [Result("bronze", 0.0, status=200, done_at=t, total_tokens=100) for t in (0, 30, 59, 61, 90, 125)]
    # 0..59 holds three, 30..90 holds four (30, 59, 61, 90), 61..121 and later hold fewer.
    assert busiest_minute(results) == 400
