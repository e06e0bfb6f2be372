"""Prefill/decode disaggregation through real Envoy, as a client sees it (openai SDK): a long prompt is
prefilled on the prefill pool and decoded on the decode pool (streaming and not), a short one goes straight
to a decode worker, a client cannot pick the pair itself, and the access log names the split."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from poolgate.kernel.routing import DECODE_HEADER, PREFILL_HEADER, WORKER_HEADER
from tests.e2e.conftest import RunningStack, poolgate_up

PD_CONFIG: dict[str, Any] = {
    "key_prefix": "e2epd",
    "controller": {"token": "e2e-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"processes": 1},
    "disaggregation": {"min_prompt_tokens": 1000},
    "pools": [
        {"name": "chat-prefill", "model": "chat-model", "max_model_len": 16384, "role": "prefill"},
        {"name": "chat-decode", "model": "chat-model", "max_model_len": 16384, "role": "decode"},
    ],
    "workers": [
        {"id": "prefill-a", "pool": "chat-prefill"},
        {"id": "decode-a", "pool": "chat-decode"},
        {"id": "decode-b", "pool": "chat-decode"},
    ],
}
LONG = "Summarise the quarterly report in detail. " * 300  # ~3,000 tokens: split
SHORT = "Hello there"


@pytest.fixture(scope="module")
def pd_stack(redis_server: object) -> Iterator[RunningStack]:
    with poolgate_up(PD_CONFIG, redis_server.url) as running:  # type: ignore[attr-defined]
        took = wait_until_split(running, timeout_s=60)
        print(f"the first long prompt was split {took:.2f} s after the stack was ready")
        yield running


def wait_until_split(stack: RunningStack, timeout_s: float) -> float:
    """Seconds until a long prompt is split. The stack is ready once one request per model was answered,
    which a decode worker can do while the prefill worker still starts (a machine under load)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        raw = client(stack).chat.completions.with_raw_response.create(
            model="chat-model", messages=[{"role": "user", "content": "Warm-up. " + LONG}], max_tokens=1)
        if raw.headers.get("x-poolgate-pd"):
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"no long prompt was split within {timeout_s} s")


def client(stack: RunningStack, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, default_headers=headers)


def split_of(value: str | None) -> dict[str, str]:
    assert value, "the response names no split"
    return dict(part.split("=", 1) for part in value.split())


def test_long_prompt_streams_from_the_decode_pool_after_a_remote_prefill(pd_stack: RunningStack) -> None:
    raw = client(pd_stack).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": LONG}], max_tokens=16, stream=True,
        stream_options={"include_usage": True})
    split = split_of(raw.headers.get("x-poolgate-pd"))
    assert split["prefill"] == pd_stack.address("prefill-a")
    assert split["decode"] in (pd_stack.address("decode-a"), pd_stack.address("decode-b"))
    assert split["fallback"] == "-" and int(split["kv_tokens"]) > 1000
    assert raw.headers[WORKER_HEADER].startswith("decode-")
    text, usage = "", None
    for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text and usage is not None and usage.completion_tokens == 16


def test_long_prompt_without_streaming(pd_stack: RunningStack) -> None:
    raw = client(pd_stack).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": "Another one. " + LONG}], max_tokens=8)
    answer = raw.parse()
    assert split_of(raw.headers.get("x-poolgate-pd"))["prefill"] == pd_stack.address("prefill-a")
    assert answer.choices[0].message.content and answer.usage is not None and answer.usage.completion_tokens == 8


def test_short_prompts_go_straight_to_decode_workers(pd_stack: RunningStack) -> None:
    for _ in range(6):
        raw = client(pd_stack).chat.completions.with_raw_response.create(
            model="chat-model", messages=[{"role": "user", "content": SHORT}], max_tokens=4)
        assert raw.headers[WORKER_HEADER].startswith("decode-")
        assert "x-poolgate-pd" not in raw.headers


def test_client_cannot_choose_the_pair(pd_stack: RunningStack) -> None:
    forged = {PREFILL_HEADER: "127.0.0.1:1", DECODE_HEADER: "127.0.0.1:2"}
    short = client(pd_stack, **forged).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": SHORT}], max_tokens=4)
    assert short.headers[WORKER_HEADER].startswith("decode-") and "x-poolgate-pd" not in short.headers
    long = client(pd_stack, **forged).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": "Forged. " + LONG}], max_tokens=4)
    split = split_of(long.headers.get("x-poolgate-pd"))
    assert split["prefill"] == pd_stack.address("prefill-a") and split["decode"] != "127.0.0.1:2"


def test_access_log_names_the_split(pd_stack: RunningStack) -> None:
    client(pd_stack).chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": "Logged. " + LONG}], max_tokens=4)
    prefill = pd_stack.address("prefill-a")
    deadline = time.monotonic() + 10  # Envoy flushes its access log about every second
    while time.monotonic() < deadline:
        lines = (pd_stack.run_dir / "envoy-access.log").read_text().splitlines()
        if any(f'pd="prefill={prefill} ' in line and "cluster=poolgate-pd-sidecar" in line for line in lines):
            return
        time.sleep(0.2)
    raise AssertionError("no access log line names the split:\n" + "\n".join(lines[-5:]))
