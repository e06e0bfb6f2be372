"""What the chaos soak measures, apart from the stack it measures: pure figures over recorded requests,
quota counter readings and memory samples, plus the one client step that needs a clock (reading a stream
with a hang detector). Tests drive all of it with fakes of known timing.

- A stream ends one of four ways: ``completed`` (``[DONE]`` and no error event), ``error event`` (the
  router or worker said what went wrong inside the stream), ``cut`` (the connection closed or broke without
  ``[DONE]``: the client notices at once, so it is an error, not a hang) and ``hung`` (no byte for
  ``idle_s``, or still open after ``total_s``: the client would wait forever).
- TTFT per minute: p99 over the requests sent in that minute that got a first token (the first text event
  of a stream; the whole answer of a non-streaming request); failures are counted beside it.
- Quota drift: the tenant's per-minute token counters in Redis against the usage its answers reported.
  A request cut by a fault after admission keeps its reservation (nobody saw its usage), and so does one
  whose extproc process died before it could correct the charge (or whose correction met a dead Redis);
  the drift a run may show is bounded by those requests' reservations; the report gives both.
- Memory: every process's RSS sampled through the run; a process restarted by a fault is the same service,
  so a service's trend runs across its incarnations, without the first ``warm_s`` of each one.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import SseTally
from bench.measure import percentile

STREAMING = "streaming"
NON_STREAMING = "non-streaming"
COMPLETED, ERROR_EVENT, CUT, HUNG = "completed", "error event", "cut", "hung"
STREAM_ENDS = (COMPLETED, ERROR_EVENT, CUT, HUNG)
TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def rss_mib(pid: int) -> float | None:
    """A process's resident memory in MiB from /proc (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Sent:
    """One request of the soak as the client saw it."""

    mode: str
    """``STREAMING`` or ``NON_STREAMING``."""
    workload: str
    sent_s: float
    """Seconds from the start of the soak."""
    ok: bool = False
    ttft_s: float | None = None
    status: int = 0
    error: str = ""
    end: str = ""
    """How a stream ended (``STREAM_ENDS``); empty for a non-streaming request."""
    tenant: str = ""
    usage_tokens: int | None = None
    """``total_tokens`` the answer reported."""
    elapsed_s: float = 0.0


@dataclass
class StreamEnd:
    end: str
    ttft_s: float | None
    usage_tokens: int | None
    elapsed_s: float


async def read_stream(chunks: AsyncIterator[bytes], *, idle_s: float, total_s: float,
                      clock: Callable[[], float] = time.monotonic) -> StreamEnd:
    """Follow an SSE body to its end; a stream silent for ``idle_s`` or open past ``total_s`` is ``hung``.

    A broken connection (any exception from ``chunks``) is ``cut``; the caller closes the connection of a
    hung stream."""
    started = clock()
    tally = SseTally()
    ttft: float | None = None
    usage: int | None = None
    iterator = aiter(chunks)
    while True:
        left = min(idle_s, total_s - (clock() - started))
        if left <= 0:
            return StreamEnd(HUNG, ttft, usage, clock() - started)
        try:
            chunk = await asyncio.wait_for(anext(iterator), left)
        except StopAsyncIteration:
            break
        except TimeoutError:
            return StreamEnd(HUNG, ttft, usage, clock() - started)
        except Exception:  # any transport failure the client sees ends the stream as cut
            return StreamEnd(CUT, ttft, usage, clock() - started)
        if tally.feed(chunk) and ttft is None:
            ttft = clock() - started
        if (found := TOTAL_TOKENS.search(chunk)) is not None:
            usage = int(found.group(1))
    end = ERROR_EVENT if tally.error else COMPLETED if tally.done else CUT
    return StreamEnd(end, ttft, usage, clock() - started)


def class_rows(sent: Sequence[Sent]) -> list[dict[str, Any]]:
    """Success per class (non-streaming, streaming), with how streams ended and the errors seen."""
    rows: list[dict[str, Any]] = []
    for mode in (NON_STREAMING, STREAMING):
        mine = [s for s in sent if s.mode == mode]
        errors: dict[str, int] = {}
        for s in mine:
            if not s.ok:
                errors[s.error] = errors.get(s.error, 0) + 1
        ends = {end: sum(s.end == end for s in mine) for end in STREAM_ENDS} if mode == STREAMING else {}
        ok = sum(s.ok for s in mine)
        rows.append({"class": mode, "sent": len(mine), "succeeded": ok, "failed": len(mine) - ok,
                     "success_pct": 100.0 * ok / len(mine) if mine else math.nan, **ends,
                     "errors": ", ".join(f"{name} ×{n}" for name, n in sorted(errors.items(), key=lambda e: -e[1]))
                     or "-"})
    return rows


def per_minute(sent: Sequence[Sent], minute_s: float = 60.0) -> list[dict[str, Any]]:
    """Per minute of sending: requests, failures and p99 TTFT (ms) of streams and non-streaming requests."""
    if not sent:
        return []
    rows = []
    for index in range(int(max(s.sent_s for s in sent) // minute_s) + 1):
        mine = [s for s in sent if index * minute_s <= s.sent_s < (index + 1) * minute_s]
        row: dict[str, Any] = {"minute": index + 1, "requests": len(mine), "failed": sum(not s.ok for s in mine)}
        for mode, key in ((STREAMING, "stream_p99_ttft_ms"), (NON_STREAMING, "non_stream_p99_ttft_ms")):
            ttfts = [s.ttft_s for s in mine if s.mode == mode and s.ttft_s is not None]
            row[key] = percentile(ttfts, 0.99) * 1000 if ttfts else math.nan
        rows.append(row)
    return rows


@dataclass
class QuotaLedger:
    """The quota tenant's charges: what Redis counted per minute, and what its answers reported."""

    tenant: str
    reservation_bound: int
    """Most tokens one admission reserves (the pool's context length): bounds what a cut request leaves."""
    epoch_s: float = 0.0
    """Wall-clock time (``time.time()``) at ``sent_s`` = 0, to put requests in the counters' minutes."""
    counted: dict[int, int] = field(default_factory=dict)
    """Calendar minute → the latest reading of its counter."""

    def observe(self, minute: int, value: int | None) -> None:
        """A reading; a counter that expired (None) keeps its last value."""
        if value is not None:
            self.counted[minute] = value

    def at_risk(self, sent: Sequence[Sent], outages: Sequence[tuple[float, float]]) -> list[Sent]:
        """The tenant's requests whose charge may be wrong: failed after admission, or sent or in flight
        during an outage of the bookkeeping (``outages``: (from, to) seconds; an extproc process killed, so
        its corrections are never written, or Redis away, so admission fails open and charges nothing)."""
        def touched(s: Sent) -> bool:
            return any(s.sent_s <= to and s.sent_s + s.elapsed_s >= since for since, to in outages)
        return [s for s in sent if s.tenant == self.tenant
                and ((not s.ok and s.status not in (400, 401, 403, 404, 413, 429)) or touched(s))]

    def verdict(self, sent: Sequence[Sent], outages: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
        """Counted against reported tokens. A drift up is bounded by a full reservation per request at risk
        (charged, never corrected); a drift down by the usage those requests reported (never charged)."""
        mine = [s for s in sent if s.tenant == self.tenant]
        reported = sum(s.usage_tokens or 0 for s in mine if s.ok)
        risky = self.at_risk(sent, outages)
        counted = sum(self.counted.values())
        drift = counted - reported
        bound = len(risky) * self.reservation_bound if drift >= 0 else sum(s.usage_tokens or 0 for s in risky)
        return {"tenant": self.tenant, "requests": len(mine), "succeeded": sum(s.ok for s in mine),
                "usage_reported_tokens": reported, "counted_tokens": counted, "drift_tokens": drift,
                "drift_pct": 100.0 * drift / reported if reported else math.nan,
                "at_risk_requests": len(risky), "drift_bound_tokens": bound,
                "unexplained_drift_tokens": max(0, abs(drift) - bound), "no_drift": abs(drift) <= bound}

    def minutes(self, sent: Sequence[Sent], outages: Sequence[tuple[float, float]] = ()) -> list[dict[str, Any]]:
        """Per calendar minute: counted, reported by the requests sent in it, and how many were at risk (a
        request sent a moment before a minute ends may be charged in the next)."""
        risky = {id(s) for s in self.at_risk(sent, outages)}
        rows: dict[int, dict[str, Any]] = {m: {"minute": m, "counted": v, "reported": 0, "at_risk": 0}
                                           for m, v in sorted(self.counted.items())}
        for s in sent:
            if s.tenant != self.tenant:
                continue
            minute = int((self.epoch_s + s.sent_s) // 60)
            row = rows.setdefault(minute, {"minute": minute, "counted": 0, "reported": 0, "at_risk": 0})
            row["reported"] += (s.usage_tokens or 0) if s.ok else 0
            row["at_risk"] += id(s) in risky
        for row in rows.values():
            row["drift"] = row["counted"] - row["reported"]
        return [rows[m] for m in sorted(rows)]


@dataclass(frozen=True)
class MemorySample:
    at_s: float
    service: str
    pid: int
    rss_mib: float


def memory_rows(samples: Sequence[MemorySample], window_from_s: float, tolerance: float,
                warm_s: float = 60.0) -> list[dict[str, Any]]:
    """Per service: RSS at start and end, restarts, and the change over the window (``window_from_s`` to the
    end) between its first and last warm sample; ``within`` is None when the window holds too few samples."""
    rows = []
    for service in dict.fromkeys(s.service for s in samples):
        mine = sorted((s for s in samples if s.service == service), key=lambda s: s.at_s)
        born: dict[int, float] = {}
        for s in mine:
            born.setdefault(s.pid, s.at_s)
        first_seen = mine[0].at_s
        warm = [s for s in mine if s.at_s >= window_from_s
                and (born[s.pid] == first_seen or s.at_s - born[s.pid] >= warm_s)]
        change = (warm[-1].rss_mib - warm[0].rss_mib) / warm[0].rss_mib if len(warm) >= 2 else math.nan
        rows.append({"process": service, "start_mib": mine[0].rss_mib, "end_mib": mine[-1].rss_mib,
                     "incarnations": len(born), "window_change_pct": change * 100,
                     "within": None if math.isnan(change) else abs(change) <= tolerance})
    return rows
