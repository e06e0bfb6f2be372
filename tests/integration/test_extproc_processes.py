"""Several extproc processes behind one Envoy (``extproc.processes``), started by ``poolgate up``: streams
spread over all of them, their KV reservations add up across processes (a burst split over four processes
never overcommits one small worker), a tenant's requests-per-minute quota holds over all of them, and
fail-open holds with any process killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.redis_deployments import RedisServer
from extproc.tenancy import key_digest
from poolgate.procs import free_port
from tests.e2e.conftest import RunningStack, poolgate_up

PROCESSES = 4
BURST = 200
PROMPT_CHARS = 1600  # ~400 tokens at the default 4 characters per token
OUTPUT_TOKENS = 200
KV_BLOCKS, BLOCK = 256, 16  # 4,096 tokens: about six of these requests at once
CAPPED_KEY, CAPPED_RPM = "pg-capped-key", 10


def config(metrics_port: int) -> dict[str, Any]:
    return {
        "key_prefix": "procs",
        "controller": {"token": "procs-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
        "extproc": {"processes": PROCESSES, "max_request_bytes": 1048576},
        "observability": {"extproc_metrics_port": metrics_port},
        "scheduling": {"max_wait_s": 50},
        "tenants": [{"name": "capped", "api_key_sha256": [key_digest(CAPPED_KEY)],
                     "requests_per_minute": CAPPED_RPM}],
        "pools": [{"name": "small", "model": "small-model", "max_model_len": 2048}],
        "workers": [{"id": "small-1", "pool": "small", "extra_args": [
            "--num-gpu-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--time-scale", "20",
            "--no-enable-prefix-caching"]}],
    }


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Any:
    with poolgate_up(config(free_port()), redis_server.url) as running:
        yield running


def process_metric(stack: RunningStack, index: int, name: str, **labels: str) -> float:
    listed = json.loads((stack.run_dir / "extproc.json").read_text())
    port = listed[f"extproc-{index}" if index else "extproc"]["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def worker_metric(stack: RunningStack, name: str) -> float:
    text = httpx.get(f"http://{stack.address('small-1')}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


async def burst(base_url: str, count: int, key: str | None = None, output_tokens: int = OUTPUT_TOKENS) -> list[int]:
    body = {"model": "small-model", "messages": [{"role": "user", "content": "word " * (PROMPT_CHARS // 5)}],
            "max_tokens": output_tokens, "ignore_eos": True}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as http:
        responses = await asyncio.gather(*(http.post(f"{base_url}/chat/completions", json=body)
                                           for _ in range(count)))
    return [r.status_code for r in responses]


def test_a_burst_split_over_four_processes_never_overcommits_one_small_worker(stack: RunningStack) -> None:
    assert sum(1 for name in stack.children() if name.startswith("extproc")) == PROCESSES
    time.sleep(2)  # every process has seen the others' presence (written each second)
    preemptions = worker_metric(stack, "vllm:num_preemptions_total")
    routed = [process_metric(stack, i, "poolgate_extproc_requests_total", outcome="routed")
              for i in range(PROCESSES)]
    held = sum(process_metric(stack, i, "poolgate_extproc_hold_seconds_count") for i in range(PROCESSES))
    started = time.monotonic()
    statuses = asyncio.run(burst(stack.base_url, BURST))
    print(f"{BURST} requests answered in {time.monotonic() - started:.1f} s: "
          f"{ {s: statuses.count(s) for s in set(statuses)} }")
    preempted = worker_metric(stack, "vllm:num_preemptions_total") - preemptions
    print(f"worker preemptions during the burst: {preempted:.0f}")
    # The four processes' promises add up to the worker's room: what they overcommit is at most the few tokens
    # a stream's decode room is shrunk too early by (``extproc/reservations.py`` counts a stream as writing one
    # token per inter-token gap the agent last averaged; in a burst the engine's steps slow down, so a stream
    # has written less than counted). On a loaded test host that cost 2-3 preemptions of 200 in some runs: a
    # known gap of the estimate, allowed here up to 2 % of the burst, not more.
    assert preempted <= BURST // 50, "the worker preempted requests: the processes together overcommitted its KV"
    assert statuses.count(200) == BURST
    spread = [process_metric(stack, i, "poolgate_extproc_requests_total", outcome="routed") - routed[i]
              for i in range(PROCESSES)]
    print("routed per process:", spread)
    assert sum(spread) >= BURST and all(n > 0 for n in spread), spread  # Envoy spread the streams over all
    held_now = sum(process_metric(stack, i, "poolgate_extproc_hold_seconds_count") for i in range(PROCESSES))
    assert held_now - held > BURST / 2, "the burst never had to wait: it did not test the worker's limit"


def test_a_requests_per_minute_quota_holds_across_the_processes(stack: RunningStack) -> None:
    statuses = asyncio.run(burst(stack.base_url, 4 * CAPPED_RPM, key=CAPPED_KEY, output_tokens=4))
    assert statuses.count(200) == CAPPED_RPM and statuses.count(429) == 3 * CAPPED_RPM, statuses


def test_fail_open_with_any_process_killed(stack: RunningStack) -> None:
    children = stack.children()
    for name in sorted(n for n in children if n.startswith("extproc")):
        os.kill(children[name], signal.SIGKILL)
        statuses = asyncio.run(burst(stack.base_url, 8))
        assert statuses == [200] * 8, (name, statuses)
        deadline = time.monotonic() + 30  # poolgate up restarts it
        while stack.children()[name] == children[name]:
            assert time.monotonic() < deadline, f"{name} was not restarted"
            time.sleep(0.1)
