"""Two extproc processes (``extproc.processes: 2``, started by ``poolgate up``) in front of one worker: a
prompt that needs 70 % of the worker's free KV is placed, whichever process its stream reaches. Before, each
of N processes could promise only 1/N of a worker's unreserved room, so such a prompt fitted nowhere and was
held until its wait bound, then answered 429, although the worker was idle. Two of them sent at once are
both served, one after the other, and the worker never runs out of KV (the processes do not both promise
the same room)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from bench.redis_deployments import RedisServer
from poolgate.procs import free_port
from tests.e2e.conftest import RunningStack, poolgate_up
from tests.integration.test_extproc_processes import process_metric, worker_metric

PROCESSES = 2
KV_BLOCKS, BLOCK = 512, 16  # 8,192 tokens; 8,028 free at the default kv_reserve_fraction (0.02)
PROMPT_TOKENS, OUTPUT_TOKENS = 5_400, 220  # 5,620 tokens: 70 % of the free room, 1.4 times a process's half
CHARS_PER_TOKEN = 4  # the default estimate
MAX_WAIT_S = 5.0


def config(metrics_port: int) -> dict[str, Any]:
    return {
        "key_prefix": "large",
        "controller": {"token": "large-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
        "extproc": {"processes": PROCESSES, "max_request_bytes": 1048576},
        "observability": {"extproc_metrics_port": metrics_port},
        "scheduling": {"max_wait_s": MAX_WAIT_S},
        "pools": [{"name": "small", "model": "small-model", "max_model_len": 8192}],
        "workers": [{"id": "small-1", "pool": "small", "extra_args": [
            "--num-gpu-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--time-scale", "20",
            "--no-enable-prefix-caching"]}],
    }


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Any:
    with poolgate_up(config(free_port()), redis_server.url) as running:
        yield running


async def large_prompts(base_url: str, count: int) -> list[tuple[int, float]]:
    """``count`` large prompts sent at once: each one's status and seconds to its answer. Each prompt differs
    from its first block on, so no worker's cache holds any of it: each needs its whole footprint."""

    async def one(http: httpx.AsyncClient) -> tuple[int, float]:
        words = f"{uuid.uuid4().hex} " + "word " * (PROMPT_TOKENS * CHARS_PER_TOKEN // 5 - 7)
        body = {"model": "small-model", "messages": [{"role": "user", "content": words}],
                "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
        started = time.monotonic()
        response = await http.post(f"{base_url}/chat/completions", json=body)
        return response.status_code, time.monotonic() - started

    async with httpx.AsyncClient(timeout=60) as http:
        return list(await asyncio.gather(*(one(http) for _ in range(count))))


def test_a_prompt_needing_70_percent_of_a_workers_free_kv_is_placed_through_either_process(
        stack: RunningStack) -> None:
    assert sum(1 for name in stack.children() if name.startswith("extproc")) == PROCESSES
    time.sleep(2)  # every process has seen the other's presence (written each second)
    routed = [process_metric(stack, i, "poolgate_extproc_requests_total", outcome="routed") for i in range(PROCESSES)]
    preemptions = worker_metric(stack, "vllm:num_preemptions_total")
    # One at a time, until each process has placed some: Envoy picks the process of each stream (least request,
    # all idle: a coin toss), and in one CI run all of the first eight went to the same one.
    answers: list[tuple[int, float]] = []
    spread = [0.0] * PROCESSES
    while len(answers) < 8 or (len(answers) < 32 and not all(spread)):
        answers.append(asyncio.run(large_prompts(stack.base_url, 1))[0])
        spread = [process_metric(stack, i, "poolgate_extproc_requests_total", outcome="routed") - routed[i]
                  for i in range(PROCESSES)]
    print("one at a time (status, seconds):", answers)
    print("routed per process:", spread)
    assert [status for status, _ in answers] == [200] * len(answers), answers
    assert all(n > 0 for n in spread), spread  # both processes placed some
    pairs = [asyncio.run(large_prompts(stack.base_url, 2)) for _ in range(3)]  # two at once: 1.4 × the room
    print("two at once (status, seconds):", pairs)
    assert [status for pair in pairs for status, _ in pair] == [200] * 6, pairs
    preempted = worker_metric(stack, "vllm:num_preemptions_total") - preemptions
    assert preempted == 0, "the worker preempted requests: the processes together promised the same room twice"
