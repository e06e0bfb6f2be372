"""The prefill this replica has placed on each worker and the engine has not done yet, in tokens.

A worker's engine takes waiting prompts first come, first served, and computes them at its prefill rate, so
what this replica placed there drains like a queue:

    backlog_w(t) = max(0, backlog_w(t_k) − R_w × (t − t_k)) + U_k      at each placement k (U_k: its
                                                                        uncached prompt tokens there)

read at any time t as max(0, backlog_w(t_k) − R_w × (t − t_k)), with R_w the rate the pick predicts with:
the fastest prefill rate the worker's kind has shown (``scheduling.rates``, from the records'
``prefill_tokens_per_s``; the configured default while unknown). This is what a pick needs to know of the
queue ahead of a new request: how many tokens, not how many requests, and at once, not a metrics scrape
later. The engine's own ``waiting`` count only says how many requests queue, and arrives up
to a scrape late; the reservations' prefill part (``reservations``) is dropped once the agent has seen the
placement, long before a queued prompt is computed.

Nothing here needs the response: a drained estimate is free, where watching every response for its first
byte costs extproc CPU per chunk. A worker slower than its measured rate (more decodes than usual) keeps its
backlog longer than estimated, which a later placement's record corrects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from extproc.scheduling.rates import KindRates
from poolgate.kernel.fleet import WorkerRecord


class PrefillLedger:
    def __init__(self, default_rate: float) -> None:
        self.rates = KindRates(default_rate)
        """The rate a worker's backlog drains at: its kind's peak (``scheduling.rates``), as the pick predicts."""
        self._backlog: dict[str, tuple[float, float, float]] = {}
        """Worker id → (tokens left at ``at``, ``at``, the rate it drains at)."""

    def placed(self, worker: WorkerRecord, tokens: int, now: float) -> None:
        self.rates.observe((worker,))
        rate = self.rates.of(worker)
        self._backlog[worker.id] = (self.left(worker.id, now) + tokens, now, rate)

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

    def at(self, now: float, reserved: Mapping[str, int], own_reserved: Mapping[str, int]) -> Mapping[str, int]:
        """Worker id → prefill ahead of a request placed now: this replica's backlog plus the other replicas'
        placements not yet seen by the agent (``reserved`` less ``own_reserved``: all replicas' prefill
        reservations, and this one's, from ``reservations``)."""
        return _Ahead(self, now, reserved, own_reserved)


class _Ahead(Mapping[str, int]):
    """Read per worker on demand: a pick looks at its candidates only."""

    __slots__ = ("_ledger", "_now", "_others", "_own")

    def __init__(self, ledger: PrefillLedger, now: float, reserved: Mapping[str, int],
                 own_reserved: Mapping[str, int]) -> None:
        self._ledger = ledger
        self._now = now
        self._others = reserved
        self._own = own_reserved

    def __getitem__(self, worker_id: str) -> int:
        others = self._others.get(worker_id, 0) - self._own.get(worker_id, 0)
        return int(self._ledger.left(worker_id, self._now)) + max(0, others)

    def get(self, worker_id: str, default: int | None = 0) -> int:  # type: ignore[override]
        return self[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter({*self._ledger._backlog, *self._others})

    def __len__(self) -> int:
        return len({*self._ledger._backlog, *self._others})
