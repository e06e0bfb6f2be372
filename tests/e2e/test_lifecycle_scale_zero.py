"""Scale to zero end to end through Envoy with the openai SDK: the first request to an empty pool waits while
the controller starts workers (each takes ``STARTUP_S`` to load, as a vLLM start does) and is served; the
autoscaler's scale-down drains a worker with a stream running on it (the stream finishes, nothing is lost)
and the idle pool returns to zero after its cooldown. A cold start that outlasts its pool's wait is a 503 with
Retry-After; a pool that cannot scale to zero answers 503 at once. A pool at zero with a standby spare has it
started and put to sleep ahead of need, and its first request is served by waking it. One ``poolgate up`` stack for
the module.

The tests run in order (each starts from the state the one before left). Every "within N s" check polls with a
generous bound and prints the time it measured.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import openai
import pytest

from poolgate.procs import free_port
from tests.e2e.conftest import RunningStack, poolgate_up
from tests.e2e.test_lifecycle_fleet import wait_for

pytestmark = pytest.mark.e2e

STARTUP_S = 2.0
"""Model load of every worker the autoscaler starts for the pool ``zero``."""
COOLDOWN_S = 15.0
"""Longer than a worker takes to start here even on a loaded machine: the two woken workers must both serve."""
SPARE_STARTUP_S = 8.0
"""Model load of the pool ``spare``'s workers: its standby spare pays it before any request, a wake-up 0.2 s."""
CONFIG = {
    "key_prefix": "lcz",
    "controller": {"token": "lcz-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "health": {"probe_interval_s": 0.25, "probe_timeout_s": 0.5},
    "extproc": {"processes": 1},  # one in-flight count: two processes picking at once may both pick one worker
    "drain": {"grace_s": 60, "settle_s": 0.5, "poll_s": 0.1},
    "autoscale": {
        "enabled": True, "interval_s": 0.5, "up_step": 2, "up_sustain_s": 2.0, "down_running_per_worker": 2.0,
        "down_cooldown_s": COOLDOWN_S,
        "pools": {
            "zero": {"min_workers": 0, "max_workers": 2, "cold_start_wait_s": 60,
                     "template": {"extra_args": ["--startup-delay-s", str(STARTUP_S)]}},
            "spare": {"min_workers": 0, "max_workers": 2, "sleep_level": 1, "standby_workers": 1,
                      "cold_start_wait_s": 60, "template": {"extra_args": [
                          "--startup-delay-s", str(SPARE_STARTUP_S), "--enable-sleep-mode", "--wake-up-s", "0.2"]}},
            "slow": {"min_workers": 0, "max_workers": 1, "cold_start_wait_s": 3,
                     "template": {"extra_args": ["--startup-delay-s", "120"]}},
        },
    },
    "pools": [
        {"name": "zero", "model": "zero-model", "max_model_len": 4096},
        {"name": "spare", "model": "spare-model", "max_model_len": 4096},
        {"name": "slow", "model": "slow-model", "max_model_len": 4096},
        {"name": "fixed", "model": "fixed-model", "max_model_len": 4096},
    ],
    "workers": [],
}
MESSAGES = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def stack(redis_server: object) -> Iterator[RunningStack]:
    config = {**CONFIG, "observability": {"extproc_metrics_port": free_port()}}
    with poolgate_up(config, redis_server.url) as running:  # type: ignore[attr-defined]
        yield running


def client(stack: RunningStack, **options: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120, **options)


def workers_of(stack: RunningStack, pool: str) -> list[str]:
    return stack.pool_ids(pool)


def summed(metrics: str, name: str, labels: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and labels in line)


def test_first_request_to_an_empty_pool_is_served_once_a_worker_is_ready(stack: RunningStack) -> None:
    assert workers_of(stack, "zero") == []
    started = time.monotonic()
    answer = client(stack).chat.completions.create(model="zero-model", messages=MESSAGES, max_tokens=8)
    took = time.monotonic() - started
    print(f"\nmeasured: first request to the empty pool served {took:.2f} s after it was sent (start-up "
          f"{STARTUP_S:g} s; target start-up + 2 s = {STARTUP_S + 2:g} s)")
    assert answer.choices[0].message.content
    assert took < STARTUP_S + 60, "served within the start-up time plus a generous bound for a loaded machine"
    placed = summed(stack.extproc_metrics(), "poolgate_extproc_cold_start_wait_seconds_count",
                    'model="zero-model",outcome="placed"')
    assert placed == 1
    waits: list[int] = []

    def logged() -> bool:  # Envoy flushes its access log file about once a second
        waits[:] = map(int, re.findall(r"queue_wait_ms=(\d+)", (stack.run_dir / "envoy-access.log").read_text()))
        return bool(waits)

    wait_for(logged, 10, 0.1)
    assert max(waits) >= STARTUP_S * 1000, waits
    controller_log = (stack.run_dir / "controller.log").read_text()
    assert "waiting for an empty pool" in controller_log


async def test_scale_down_drains_a_worker_with_a_running_stream_then_the_idle_pool_returns_to_zero(
        stack: RunningStack) -> None:
    """The cold start woke two workers (``up_step``). Three streams spread over them; once the short one ends,
    two streams are running and they would fit on one worker fewer: after the cooldown the autoscaler drains one
    of the two, each carrying a stream, which finishes. When the streams end the pool goes back to zero."""
    await asyncio.to_thread(wait_for, lambda: sum(stack.state(w) == "Ready" for w in workers_of(stack, "zero")) == 2,
                            120, 0.1)
    http = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)

    async def stream(tokens: int, topic: str) -> tuple[str, int, bool]:
        """Each stream has its own prompt: a shared one would send them all to one worker (prefix affinity)."""
        worker, chunks, finished = "?", 0, False
        response = await http.chat.completions.with_raw_response.create(
            model="zero-model", messages=[{"role": "user", "content": f"{topic}: tell me everything"}],
            max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True})
        worker = response.headers.get("x-poolgate-worker", "?")
        async for chunk in response.parse():
            chunks += 1
            finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
        return worker, chunks, finished

    long_streams = [asyncio.create_task(stream(2400, "oceans"))]
    await asyncio.sleep(0.5)  # placed and counted in flight: the next pick goes to the other, idle worker
    long_streams.append(asyncio.create_task(stream(2400, "volcanoes")))
    await asyncio.sleep(0.3)
    short = await stream(150, "deserts")
    states: dict[str, set[str]] = {}

    def one_left() -> bool:
        for worker_id in workers_of(stack, "zero"):
            states.setdefault(worker_id, set()).add(stack.state(worker_id) or "gone")
        return len(workers_of(stack, "zero")) == 1

    started = time.monotonic()
    shrunk = await asyncio.to_thread(wait_for, one_left, 120, 0.05)
    drained = [w for w, seen in states.items() if "Draining" in seen]
    outcomes = await asyncio.gather(*long_streams)
    zero = await asyncio.to_thread(wait_for, lambda: workers_of(stack, "zero") == [], 120, 0.1)
    print(f"\nmeasured: 2 → 1 after {shrunk:.1f} s (drained {drained}); long streams {outcomes} (worker, chunks, "
          f"finished); short stream on {short[0]}; the idle pool was back at zero {zero:.1f} s after the streams "
          f"ended ({time.monotonic() - started:.1f} s after the short stream)")
    assert all(finished and chunks > 2000 for _, chunks, finished in outcomes), outcomes
    assert len({worker for worker, _, _ in outcomes}) == 2, "the long streams ran on both workers"
    assert len(drained) == 1 and drained[0] in {worker for worker, _, _ in outcomes}, (
        "the drained worker carried a running stream, and that stream finished")
    await http.close()


def test_a_cold_start_past_its_wait_is_503_with_retry_after(stack: RunningStack) -> None:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client(stack).chat.completions.create(model="slow-model", messages=MESSAGES, max_tokens=4)
    took = time.monotonic() - started
    error = refused.value
    print(f"\nmeasured: a cold start outlasting its 3 s wait answered {error.status_code} after {took:.2f} s")
    assert error.status_code == 503 and error.code == "cold_start_timeout"
    assert error.response.headers["retry-after"] == "10"
    assert took >= 3.0


def test_a_pool_that_cannot_scale_to_zero_answers_503_at_once(stack: RunningStack) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client(stack).chat.completions.create(model="fixed-model", messages=MESSAGES, max_tokens=4)
    assert refused.value.status_code == 503 and refused.value.code == "no_ready_worker"
    assert workers_of(stack, "fixed") == []


def test_a_standby_spare_sleeps_until_the_first_request_wakes_it(stack: RunningStack) -> None:
    def spare_asleep() -> bool:
        ids = workers_of(stack, "spare")
        return len(ids) == 1 and stack.record(ids[0]).get("sleep_level") == "1"

    slept = wait_for(spare_asleep, 120, 0.1)
    [spare] = workers_of(stack, "spare")
    started = time.monotonic()
    response = client(stack).chat.completions.with_raw_response.create(model="spare-model", messages=MESSAGES,
                                                                       max_tokens=8)
    took = time.monotonic() - started
    print(f"\nmeasured: the spare slept {slept:.1f} s into the test; the first request to the pool was served "
          f"{took:.2f} s after it was sent (a start takes {SPARE_STARTUP_S:g} s, a wake-up 0.2 s)")
    assert response.parse().choices[0].message.content
    assert response.headers["x-poolgate-worker"] == spare, "served by the spare it woke, not by a new start"
    assert stack.record(spare).get("sleep_level") == "0"
    assert f"woke {spare}" in (stack.run_dir / "controller.log").read_text()
