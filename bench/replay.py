"""Replay one trace through one router from an idle fleet and measure it; a status line while it runs.

Shared by the benchmarks that compare routers on the same workers (``scheduling``, ``peers``): wait until
every worker is idle, scrape the workers, run the open loop, wait for idle again, scrape again, and turn
the outcomes and both scrapes into a row (``measure.summarise_run``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import aiohttp

from bench.harness import cpu_times, tree_cpu_seconds
from bench.loadgen import Counters, Target, run_open_loop
from bench.measure import Scrapes, summarise_run
from bench.workload import RequestSpec


class Progress:
    """One self-rewriting status line on stderr (a line every 10 s when stderr is a file)."""

    def __init__(self, total_phases: int, stream: TextIO = sys.stderr) -> None:
        self.total = total_phases
        self.done = 0
        self.stream = stream
        self.started = time.monotonic()
        self.interactive = stream.isatty()
        self.last_line = 0.0

    def show(self, phase: str, counters: Counters | None = None, expected: int = 0) -> None:
        filled = int(20 * self.done / max(1, self.total))
        bar = "#" * filled + "." * (20 - filled)
        detail = ""
        if counters is not None:
            detail = (f" sent {counters.sent}{f'/{expected}' if expected else ''} first-token {counters.first_tokens}"
                      f" finished {counters.finished}")
        now = time.monotonic()
        line = f"[{bar}] {self.done}/{self.total} {phase:<36}{detail:<52} {now - self.started:5.0f}s"
        if self.interactive:
            self.stream.write("\r" + line)
        elif now - self.last_line >= 10.0:
            self.stream.write(line.rstrip() + "\n")
            self.last_line = now
        else:
            return
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line that stays (router order, warnings)."""
        self.stream.write(("\n" if self.interactive else "") + text + "\n")
        self.stream.flush()

    def step(self) -> None:
        self.done += 1
        self.last_line = 0.0

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


async def with_progress(progress: Progress, phase: str, counters: Counters, expected: int,
                        work: asyncio.Future[Any] | asyncio.Task[Any]) -> Any:
    while not work.done():
        progress.show(phase, counters, expected)
        await asyncio.wait({work}, timeout=0.5)
    progress.show(phase, counters, expected)
    return work.result()


class Workers(Protocol):
    async def scrape_all(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]: ...

    async def wait_idle(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> bool: ...


@dataclass(frozen=True)
class Window:
    """Wall seconds of one replay, and the time scale that converts them to model time."""

    time_scale: float
    window_s: float
    drain_s: float


async def replay(session: aiohttp.ClientSession, workers: Workers, target: Target, level: float,
                 offered_rps: float, trace: Sequence[RequestSpec], bodies: Sequence[bytes], window: Window,
                 class_names: Sequence[str], progress: Progress, phase: str) -> dict[str, Any]:
    if not await workers.wait_idle(session):
        progress.note(f"warning: fleet not idle before {phase}")
    before: Scrapes = await workers.scrape_all(session)
    cpu_before = cpu_times()
    tree_before, wall_before = tree_cpu_seconds(os.getpid()), time.monotonic()
    counters = Counters()
    work = asyncio.ensure_future(run_open_loop(
        session, target, trace, bodies, time_scale=window.time_scale, window_s=window.window_s,
        drain_s=window.drain_s, counters=counters))
    outcomes = await with_progress(progress, phase, counters, len(trace), work)
    cpu_after = cpu_times()
    bench_cores = (tree_cpu_seconds(os.getpid()) - tree_before) / (time.monotonic() - wall_before)
    await workers.wait_idle(session)
    after = await workers.scrape_all(session)
    progress.step()
    busy = (cpu_after[0] - cpu_before[0]) / max(1.0, cpu_after[1] - cpu_before[1])
    return summarise_run(target.name, level, offered_rps, outcomes, before, after, time_scale=window.time_scale,
                         window_s=window.window_s, window_tokens=counters.window_tokens, class_names=class_names,
                         cpu_busy_share=busy, bench_cpu_cores=bench_cores)
