"""A worker killed in the middle of its streams: each client sees its stream end with an error soon after,
never a hang; streams on the other workers finish; the worker comes back into rotation after a restart."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from tests.faults.harness import MODEL, FaultStack, LoadResult, Sample, report, wait_until

pytestmark = pytest.mark.e2e

STREAMS = 12
HANG_LIMIT_S = 5.0


@dataclass
class StreamEnd:
    worker: str
    done: bool
    """``data: [DONE]`` arrived."""
    error: str
    ended_at: float


async def one_stream(port: int, index: int) -> StreamEnd:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"tell me a story {index}"}],
                         "max_tokens": 600, "ignore_eos": True, "stream": True})
    timeout = aiohttp.ClientTimeout(total=30, sock_read=HANG_LIMIT_S)
    worker, seen, error = "?", b"", ""
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                headers={"content-type": "application/json"}) as response:
            worker = response.headers.get("x-poolgate-worker", "?")
            async for chunk in response.content.iter_any():
                seen = (seen + chunk)[-64:]
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = type(exc).__name__
    done = b"data: [DONE]" in seen
    if not done and not error:
        error = "stream ended without [DONE]"
    return StreamEnd(worker, done, error, time.monotonic())


def test_worker_crash_mid_stream_ends_streams_cleanly(fault_stack: FaultStack) -> None:
    stack = fault_stack
    loop = stack.background.loop
    started = time.monotonic()
    futures = [asyncio.run_coroutine_threadsafe(one_stream(stack.envoy_port, i), loop) for i in range(STREAMS)]
    time.sleep(0.8)  # every stream has its headers and is decoding
    victim = stack.workers["w3"]
    killed_at = time.monotonic()
    victim.kill(signal.SIGKILL)
    ends = [future.result(40) for future in futures]
    # A stream may finish on w3 before the kill; every other w3 stream is cut.
    cut = [e for e in ends if e.worker == "w3" and not (e.done and e.ended_at < killed_at)]
    others = [e for e in ends if e.worker != "w3"]
    last_cut_end = max((e.ended_at - killed_at for e in cut), default=0.0)
    restarted_at = time.monotonic()
    victim.start()
    address = f"127.0.0.1:{stack.worker_ports['w3']}"
    wait_until(lambda: stack.envoy_endpoints().get(address) == "healthy", 20, "w3 healthy in Envoy again")
    recovery = time.monotonic() - restarted_at
    samples = [Sample(started, e.ended_at - started, 200 if e.done else 0, e.done, e.error) for e in ends]
    report("worker-crash", LoadResult(samples), recovery,
           f"streams on the crashed worker {len(cut)} (ended {last_cut_end:.2f} s after the kill, errors "
           f"{sorted({e.error for e in cut})}), on others {len(others)} ({sum(e.done for e in others)} completed)")
    assert cut, "no stream landed on the crashed worker; the case proved nothing"
    assert all(e.error and not e.done for e in cut), cut
    assert all(e.error != "ServerTimeoutError" for e in cut), "a client hung until its read timeout"
    assert last_cut_end < HANG_LIMIT_S
    assert all(e.done for e in others), [e for e in others if not e.done]
