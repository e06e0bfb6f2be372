"""The prefill placed on each worker (by this replica, and by the others as the exchange brings it) that the
engine has not done yet, in tokens.

A worker's engine takes waiting prompts first come, first served, and computes them at its prefill rate, so
what was placed there drains like a queue:

    backlog_w(t) = max(0, backlog_w(t_k) − R_w × (t − t_k)) + U_k      at each placement k (U_k: its
                                                                        uncached prompt tokens there)

read at any time t as max(0, backlog_w(t_k) − R_w × (t − t_k)), with R_w the rate the pick predicts with:
the fastest prefill rate the worker's kind has shown (``scheduling.rates``, from the records'
``prefill_tokens_per_s``; the configured default while unknown). This is what a pick needs to know of the
queue ahead of a new request: how many tokens, not how many requests, and at once, not a metrics scrape
later. The engine's own ``waiting`` count only says how many requests queue, and arrives up
to a scrape late; the reservations' prefill part (``reservations``) is dropped once the agent has seen the
placement, long before a queued prompt is computed.

The other replicas' placements are placements on the same FCFS queue, and enter the same ledger: each
replica publishes its unsettled prefill reservation per worker and how many requests it holds (``peers``), and
an increase of one replica's figures on a worker since the last read is prefill it placed there, in that many
requests (``placed_since``), added to the backlog when this replica reads it
(``ReservationBook.take_peer_placements``), then drained like its own. Counting
the others' reservations only while they were unsettled dropped their prompts from the queue as soon as the
agent's record showed them, long before they were computed, and a replica then sent its next prompt behind
them (the lab, three H100s, shared documents at 85 %, Poisson: p99 0.362 s with one process, 0.838 s with
two and 0.893 s with four; with the others' placements in the ledger 0.645 and 0.784 s). An
increase read in the same exchange as a drop of the same replica's figure on the same worker (an older
reservation settled) is counted net: an undercount, never a double count. The number of requests matters to
the latest-placement record only: an exchange through Redis brings several placements of a replica at once, and
entered as one request they made the engine's waiting requests look that much longer (the lab, H100 shared
documents with bursts at 85 %, two replicas through Redis alone: p99 1.65 s, against 1.08 s before the record;
counted one by one, 1.20 s).

The ledger also remembers the prefill of the latest ``LATEST_PLACEMENTS`` requests placed on each worker, this
replica's and the others' as the exchange brings them (``latest_tokens``). The engine's waiting count says how many
requests queue there, not how long they are; in a first-come-first-served queue they are its latest arrivals, so
about these. The latency model reads the queue as the larger of the two (``scorers.latency``), so a queue the
drained estimate missed still counts.

Nothing here needs the response: a drained estimate is free, where watching every response for its first
byte costs extproc CPU per chunk. A worker slower than its measured rate (more decodes than usual) keeps its
backlog longer than estimated, which a later placement's record corrects.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from extproc.scheduling.rates import KindRates
from poolgate.kernel.fleet import WorkerRecord

LATEST_PLACEMENTS = 64
"""How many of a worker's latest placements ``latest_tokens`` remembers (beyond them it extrapolates)."""


class Unsettled(NamedTuple):
    """A replica's placements on a worker that the worker's record does not show yet, as it publishes them."""

    tokens: int
    """Their prefill tokens (the prompt part the worker computes)."""
    requests: int
    """How many they are."""


class PrefillLedger:
    def __init__(self, default_rate: float) -> None:
        self.rates = KindRates(default_rate)
        """The rate a worker's backlog drains at: its kind's peak (``scheduling.rates``), as the pick predicts."""
        self._backlog: dict[str, tuple[float, float, float]] = {}
        """Worker id → (tokens left at ``at``, ``at``, the rate it drains at)."""
        self._latest: dict[str, deque[int]] = {}
        """Worker id → running totals of the prefill of the placements there (every replica's this one knows
        of), the latest last."""

    def latest_tokens(self, worker_id: str, requests: int) -> int | None:
        """The prefill of the latest ``requests`` requests placed on the worker (past those remembered, at
        their mean); None before the first. An engine serves its queue first come, first served, so the
        requests it reports waiting are its latest arrivals: in tokens, about these."""
        totals = self._latest.get(worker_id)
        if totals is None:
            return None
        known = len(totals) - 1
        if requests <= known:
            return totals[-1] - totals[-1 - requests]
        return round((totals[-1] - totals[0]) * requests / known)

    def placed(self, worker: WorkerRecord, tokens: int, now: float, since: float | None = None,
               requests: int = 1) -> None:
        """``tokens`` placed on the worker ``since`` (default: ``now``) in ``requests`` requests, entered at
        ``now``: queued behind what was ahead of them then, and drained with it since; and remembered as the
        latest requests there, of equal size (``latest_tokens``: a request of this replica, or what another
        placed there since the exchange's last read, since the engine's waiting requests are every
        replica's)."""
        totals = self._latest.get(worker.id)
        if totals is None:
            totals = self._latest[worker.id] = deque((0,), maxlen=LATEST_PLACEMENTS + 1)
        base, requests = totals[-1], max(1, requests)
        for share in range(max(0, requests - LATEST_PLACEMENTS - 1), requests):
            totals.append(base + tokens * (share + 1) // requests)
        self.rates.observe((worker,))
        rate = self.rates.of(worker)
        entry = self._backlog.get(worker.id)
        start = now if since is None else min(since, now)
        if entry is not None:
            start = max(start, entry[1])
        left = self.left(worker.id, start) + tokens - rate * (now - start)
        if left > 0:
            self._backlog[worker.id] = (left, now, rate)
        else:
            self._backlog.pop(worker.id, None)

    def left(self, worker_id: str, now: float) -> float:
        entry = self._backlog.get(worker_id)
        if entry is None:
            return 0.0
        tokens, at, rate = entry
        left = tokens - rate * (now - at)
        if left <= 0:
            del self._backlog[worker_id]
            return 0.0
        return left

    def at(self, now: float) -> Mapping[str, int]:
        """Worker id → prefill ahead of a request placed now: every replica's placements this one knows of,
        drained to ``now``."""
        return _Ahead(self, now)


def placed_since(before: Mapping[tuple[str, str], Unsettled],
                 current: Mapping[tuple[str, str], Unsettled]) -> dict[str, Unsettled]:
    """Worker id → the prefill the other replicas placed there between two reads of their unsettled
    placements (``(worker id, replica)`` → ``Unsettled``): each figure's increase, at least one request where
    the tokens grew. A drop (settled, released) adds nothing, and a figure read for the first time is new in
    full."""
    placed: dict[str, Unsettled] = {}
    for key, (tokens, requests) in current.items():
        was = before.get(key, Unsettled(0, 0))
        more_tokens, more_requests = max(0, tokens - was.tokens), max(0, requests - was.requests)
        if more_tokens or more_requests:
            known = placed.get(key[0], Unsettled(0, 0))
            placed[key[0]] = Unsettled(known.tokens + more_tokens, known.requests + max(1, more_requests))
    return placed


class _Ahead(Mapping[str, int]):
    """Read per worker on demand: a pick looks at its candidates only."""

    __slots__ = ("_ledger", "_now")

    def __init__(self, ledger: PrefillLedger, now: float) -> None:
        self._ledger = ledger
        self._now = now

    def __getitem__(self, worker_id: str) -> int:
        return int(self._ledger.left(worker_id, self._now))

    def get(self, worker_id: str, default: int | None = 0) -> int:  # type: ignore[override]
        return self[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._ledger._backlog))

    def __len__(self) -> int:
        return len(self._ledger._backlog)
