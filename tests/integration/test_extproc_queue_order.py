"""Class order across extproc processes, through real Envoy (``poolgate up`` with four processes): with one
small worker saturated, a high-class request sent after low-class ones are already held is placed before
every one of them, wherever Envoy sent each stream; and the running streams' in-flight count in Redis adds
up over the processes that placed them.

The blockers end one by one, so room grows in steps: the low-class requests would fit the worker's free room
a step before the larger high-class one does (each larger than what is free while the blockers run, and than
a process's share of it, so each waits for its process's turn on the worker). Without the shared order the
processes holding them place them then, before the high-class request."""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis

from extproc.tenancy import key_digest
from poolgate.kernel.keys import RedisKeys
from poolgate.procs import free_port
from tests.conftest import RedisServer
from tests.e2e.conftest import RunningStack, poolgate_up

PROCESSES = 4
KV_BLOCKS, BLOCK = 256, 16  # 4,096 tokens
TIME_SCALE = 0.2  # the simulated engine runs five times slower than real time: blockers last seconds
# The workers publish KV events, so extproc counts prompts exactly with the simulator's tokenizer: one token a
# word, and 8 of the chat template.
BLOCKERS, BLOCKER_WORDS = 8, 80  # 88 prompt tokens (6 blocks) …
BLOCKER_OUTPUTS = [190 + 5 * i for i in range(BLOCKERS)]  # … and 190 to 225 output: ending ~0.2 s apart
# 1,780 and 1,980 tokens with their output: neither fits the ~1,550-1,730 free while the blockers run (their
# prompts and decode rooms); the first blocker's end makes room for the low-class ones, the second's for both.
LOW_REQUESTS, LOW_WORDS, VIP_WORDS, HELD_OUTPUT = 8, 1752, 1952, 20
VIP_KEY, BULK_KEY = "pg-vip-key", "pg-bulk-key"
ORDER_TOLERANCE_MS = 20
"""Two requests placed a moment apart may reach the worker in either order (Envoy, the worker's loop)."""


def config(metrics_port: int) -> dict[str, Any]:
    return {
        "key_prefix": "order",
        "controller": {"token": "order-token"},
        "extproc": {"processes": PROCESSES},
        "observability": {"extproc_metrics_port": metrics_port},
        "scheduling": {"max_wait_s": 50},
        "tenants": [{"name": "vip", "api_key_sha256": [key_digest(VIP_KEY)], "priority": "high"},
                    {"name": "bulk", "api_key_sha256": [key_digest(BULK_KEY)], "priority": "low"}],
        "pools": [{"name": "small", "model": "small-model", "max_model_len": 2048}],
        "workers": [{"id": "small-1", "pool": "small", "extra_args": [
            "--num-gpu-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--time-scale", str(TIME_SCALE),
            "--no-enable-prefix-caching"]}],
    }


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Any:
    with poolgate_up(config(free_port()), redis_server.url) as running:
        yield running


def held_requests(stack: RunningStack) -> float:
    """Requests held now, summed over the processes."""
    return sum(float(value) for value in re.findall(r"^poolgate_extproc_held_requests (\S+)$",
                                                    stack.extproc_metrics(), re.MULTILINE))


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"timed out after {timeout_s} s waiting until {what}"
        time.sleep(0.05)
    print(f"{what}: after {time.monotonic() - started:.2f} s")


async def chat(http: httpx.AsyncClient, base_url: str, key: str | None, words: int, output_tokens: int) -> str:
    """One streamed chat request; its request id (read back in the access log)."""
    body = {"model": "small-model", "stream": True, "max_tokens": output_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "word " * words}]}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with http.stream("POST", f"{base_url}/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for _ in response.aiter_bytes():
            pass
        return response.headers["x-request-id"]


def reached_worker(stack: RunningStack, request_ids: list[str]) -> dict[str, float]:
    """Request id → when the worker answered its headers (ms since the epoch), which a simulated worker does
    as soon as it takes a stream: the access log's start plus its time to the first upstream byte. (The start
    plus the queue wait would miss the time before extproc queued it, which load stretches.)"""
    log = stack.run_dir / "envoy-access.log"
    found: dict[str, float] = {}

    def all_logged() -> bool:
        for line in log.read_text().splitlines() if log.exists() else ():
            match = re.match(r"\[(\S+)\] .* ttfb=(\d+) .* id=(\S+) ", line)
            if match and match.group(3) in request_ids:
                started = datetime.fromisoformat(match.group(1).replace("Z", "+00:00")).timestamp() * 1000
                found[match.group(3)] = started + int(match.group(2))
        return len(found) == len(request_ids)

    wait_until(all_logged, 15, "Envoy logged every request")  # it flushes its access log about once a second
    return found


def test_a_high_class_request_goes_before_low_class_ones_held_in_other_processes(stack: RunningStack) -> None:
    assert sum(1 for name in stack.children() if name.startswith("extproc")) == PROCESSES
    time.sleep(2)  # every process has seen the others' presence (written each second)
    inflight_key = RedisKeys(stack.prefix).inflight
    store = redis.Redis.from_url(stack.redis_url)

    async def scenario() -> tuple[list[str], list[str], str]:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            blockers = [asyncio.create_task(chat(http, stack.base_url, None, BLOCKER_WORDS, output))
                        for output in BLOCKER_OUTPUTS]
            await asyncio.to_thread(wait_until, lambda: int(store.hget(inflight_key, "small-1") or 0) == BLOCKERS, 30,
                                    f"Redis counts the {BLOCKERS} blockers in flight, from every process")
            await asyncio.sleep(0.5)  # every process has read the others' reservations (their next refresh)
            lows = [asyncio.create_task(chat(http, stack.base_url, BULK_KEY, LOW_WORDS, HELD_OUTPUT))
                    for _ in range(LOW_REQUESTS)]
            await asyncio.to_thread(wait_until, lambda: held_requests(stack) == LOW_REQUESTS, 60,
                                    "every low-class request is held")
            vip = asyncio.create_task(chat(http, stack.base_url, VIP_KEY, VIP_WORDS, HELD_OUTPUT))
            await asyncio.to_thread(wait_until, lambda: held_requests(stack) == LOW_REQUESTS + 1, 60,
                                    "the high-class request is held too")
            await asyncio.sleep(0.5)  # its process's report has reached the others (flush, then their refresh)
            assert not any(task.done() for task in blockers), "the worker freed room before the test was set up"
            return (await asyncio.gather(*blockers), await asyncio.gather(*lows), await vip)

    try:
        blocker_ids, low_ids, vip_id = asyncio.run(scenario())
    finally:
        store.close()
    reached = reached_worker(stack, [vip_id, *low_ids])
    after = sorted(round(reached[i] - reached[vip_id]) for i in low_ids)
    print(f"low-class requests reached the worker this long after the high-class one (ms): {after}")
    assert all(gap >= -ORDER_TOLERANCE_MS for gap in after), (
        "a low-class request was placed while a high-class one waited in another process")
    assert len(blocker_ids) == BLOCKERS
