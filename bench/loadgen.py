"""The load generator: open-loop traces and closed-loop saturation runs over streamed OpenAI requests.

Every request streams, so the client sees its first token: TTFT is the time from sending to the first SSE
event that carries a token (the chat role-only opening event does not count), e2e the time to ``[DONE]``.
The stream is read in raw chunks and events are counted by their ``data: `` marker, which keeps the
client's CPU cost per token small. All times here are wall seconds; the caller converts to model time.

Open loop: one dispatcher sends each request at its arrival time (``arrival_s / time_scale`` after the
start) and records how late it was. After the arrival window the run waits for every first token (up to
a drain limit), then cuts whatever still streams; a cut request keeps its TTFT and its elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.workload import CHAT_PATH, RequestSpec

MARKER = b"data: "


@dataclass(frozen=True)
class Target:
    """Where requests go: Envoy's base URL and the extra headers a policy needs for one request."""

    name: str
    base_url: str
    headers: Callable[[RequestSpec], Mapping[str, str]]


@dataclass
class Outcome:
    spec: RequestSpec
    sent_s: float = 0.0
    """Wall seconds from the run start."""
    lateness_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    """Set when the stream ended with ``[DONE]``; for a cut request, the elapsed time at the cut."""
    tokens: int = 0
    status: int = 0
    error: str | None = None
    completed: bool = False
    cut: bool = False


@dataclass
class Counters:
    """Live totals for the progress line and the throughput window."""

    sent: int = 0
    first_tokens: int = 0
    finished: int = 0
    tokens: int = 0
    window_tokens: int = 0
    window_end: float = float("inf")
    first_token_times: list[float] = field(default_factory=list)
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on every first token and every finished request."""


async def stream_one(session: aiohttp.ClientSession, target: Target, spec: RequestSpec, body: bytes,
                     outcome: Outcome, counters: Counters) -> None:
    """Send one request and follow its stream; every failure ends up in ``outcome.error``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    opening_events = 1 if spec.path == CHAT_PATH else 0
    headers = {"content-type": "application/json", **target.headers(spec)}
    try:
        async with session.post(target.base_url + spec.path, data=body, headers=headers) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            events = 0
            tail = b""
            done = False
            async for chunk in response.content.iter_any():
                data = tail + chunk
                tail = data[-(len(MARKER) - 1):]  # a marker split across chunks is counted once, next time
                found = data.count(MARKER)
                if not found:
                    continue
                events += found
                if b"[DONE]" in data:
                    done = True
                if b'"error"' in data:
                    outcome.error = "error event in the stream"
                tokens = max(0, events - opening_events - (1 if done else 0))
                new_tokens = tokens - outcome.tokens
                if new_tokens > 0:
                    now = loop.time()
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - started
                        counters.first_tokens += 1
                        counters.first_token_times.append(now)
                        counters.progressed.set()
                    outcome.tokens = tokens
                    counters.tokens += new_tokens
                    if now <= counters.window_end:
                        counters.window_tokens += new_tokens
            if done and outcome.error is None:
                outcome.completed = True
                outcome.e2e_s = loop.time() - started
            elif outcome.error is None:
                outcome.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        outcome.cut = True
        outcome.e2e_s = loop.time() - started
        raise
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        outcome.error = f"{type(error).__name__}: {error}"[:200]
    finally:
        counters.finished += 1
        counters.progressed.set()


async def run_open_loop(session: aiohttp.ClientSession, target: Target, trace: Sequence[RequestSpec],
                        bodies: Sequence[bytes], *, time_scale: float, window_s: float, drain_s: float,
                        counters: Counters) -> list[Outcome]:
    """Replay ``trace`` (model-time arrivals) over a wall window of ``window_s``; cut at most ``drain_s`` later."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    counters.window_end = start + window_s
    outcomes = [Outcome(spec) for spec in trace]
    tasks: list[asyncio.Task[None]] = []
    for spec, body, outcome in zip(trace, bodies, outcomes, strict=True):
        due = start + spec.arrival_s / time_scale
        if due > start + window_s:
            break
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        now = loop.time()
        outcome.sent_s = now - start
        outcome.lateness_s = max(0.0, now - due)
        counters.sent += 1
        tasks.append(asyncio.create_task(stream_one(session, target, spec, body, outcome, counters)))
    await asyncio.sleep(max(0.0, start + window_s - loop.time()))
    deadline = start + window_s + drain_s
    sent = outcomes[:len(tasks)]
    while loop.time() < deadline and any(o.ttft_s is None and not t.done() for o, t in zip(sent, tasks, strict=True)):
        counters.progressed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(counters.progressed.wait(), deadline - loop.time())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sent


async def run_closed_loop(session: aiohttp.ClientSession, target: Target, requests: Sequence[RequestSpec],
                          bodies: Sequence[bytes], *, concurrency: int, warmup_s: float, window_s: float,
                          counters: Counters) -> tuple[int, list[Outcome]]:
    """``concurrency`` clients send back to back from ``requests`` (cycled); returns the number of first
    tokens (admissions) seen inside the window after ``warmup_s`` — wall seconds — and all outcomes."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    counters.window_end = start + warmup_s + window_s
    outcomes: list[Outcome] = []
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while True:
            index = next_index % len(requests)
            next_index += 1
            outcome = Outcome(requests[index], sent_s=loop.time() - start)
            outcomes.append(outcome)
            counters.sent += 1
            await stream_one(session, target, requests[index], bodies[index], outcome, counters)

    clients = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(warmup_s)
    before = counters.first_tokens
    await asyncio.sleep(window_s)
    admitted = counters.first_tokens - before
    for task in clients:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*clients, return_exceptions=True)
    return admitted, outcomes


def new_session() -> aiohttp.ClientSession:
    """One client for a whole run: no connection cap, no total timeout (the run cuts streams itself)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=False))
