"""Open- and closed-loop load generators for the benchmarks, with per-request client-side timings.

Every request streams, so the client sees its first token: TTFT is the time from sending to the first SSE
event that carries generated text (a chat role chunk with empty content does not count), e2e the time to
``[DONE]``. ``SseTally`` splits the stream into events and counts the ones with text. All times here are
wall seconds; the caller converts to model time.

Open loop: one dispatcher sends each request at its arrival time (``arrival_s / time_scale`` after the
start) and records how late it was. After the arrival window the run waits for every first token (up to
a drain limit), then cuts whatever still streams; a cut request keeps its TTFT and its elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.workload import RequestSpec

TEXT_EVENT = re.compile(rb'"(?:content|text)"\s*:\s*"(?!")')
"""An event whose delta (chat) or text (completions) is not empty: one or more generated tokens."""
USAGE_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def _no_headers(spec: RequestSpec) -> Mapping[str, str]:
    return {}


@dataclass(frozen=True)
class Target:
    """Where requests go: the base URL for one request (a router per model, or one for all) and the extra
    headers a router needs for it."""

    name: str
    url_of: Callable[[RequestSpec], str]
    headers: Callable[[RequestSpec], Mapping[str, str]] = _no_headers

    @classmethod
    def single(cls, name: str, base_url: str,
               headers: Callable[[RequestSpec], Mapping[str, str]] = _no_headers) -> Target:
        return cls(name, lambda spec: base_url, headers)


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
    usage_tokens: int | None = None
    """``completion_tokens`` of the final usage chunk, when the stream got that far."""
    status: int = 0
    error: str | None = None
    completed: bool = False
    cut: bool = False
    token_gaps_s: list[float] = field(default_factory=list)
    """Wall seconds between a stream's chunks of tokens after its first (inter-token latency samples)."""
    last_token_s: float | None = None

    @property
    def refused(self) -> bool:
        return self.status == 429


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


class SseTally:
    """Splits a server-sent-event byte stream into events; counts text events, notes [DONE], errors, usage."""

    def __init__(self) -> None:
        self.pending = b""
        self.tokens = 0
        self.done = False
        self.error = False
        self.usage_tokens: int | None = None

    def feed(self, chunk: bytes) -> int:
        """Take the next bytes; returns how many new text events they completed."""
        data = self.pending + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self.pending = data.split(b"\n\n")
        new = 0
        for event in events:
            payload = event[5:].strip() if event.startswith(b"data:") else b""
            if not payload:
                continue
            if payload == b"[DONE]":
                self.done = True
            elif TEXT_EVENT.search(payload):
                new += 1
            elif b'"error"' in payload:
                self.error = True
            elif (usage := USAGE_TOKENS.search(payload)) is not None:
                self.usage_tokens = int(usage.group(1))
        self.tokens += new
        return new


def _note_tokens(outcome: Outcome, counters: Counters, new_tokens: int, now: float, started: float) -> None:
    if outcome.last_token_s is not None:
        outcome.token_gaps_s.append(now - outcome.last_token_s)
    outcome.last_token_s = now
    if outcome.ttft_s is None:
        outcome.ttft_s = now - started
        counters.first_tokens += 1
        counters.first_token_times.append(now)
        counters.progressed.set()
    outcome.tokens += new_tokens
    counters.tokens += new_tokens
    if now <= counters.window_end:
        counters.window_tokens += new_tokens


async def stream_one(session: aiohttp.ClientSession, target: Target, spec: RequestSpec, body: bytes,
                     outcome: Outcome, counters: Counters) -> None:
    """Send one request and follow its stream; every failure ends up in ``outcome.error``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    headers = {"content-type": "application/json", **target.headers(spec)}
    tally = SseTally()
    try:
        async with session.post(target.url_of(spec) + spec.path, data=body, headers=headers) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for chunk in response.content.iter_any():
                new_tokens = tally.feed(chunk)
                if new_tokens:
                    _note_tokens(outcome, counters, new_tokens, loop.time(), started)
            outcome.usage_tokens = tally.usage_tokens
            if tally.error:
                outcome.error = "error event in the stream"
            elif tally.done:
                outcome.completed = True
                outcome.e2e_s = loop.time() - started
            else:
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
