"""Optimistic KV and prefill accounting for what this replica placed but the fleet records do not show yet.

The agent refreshes a worker's record every ≤ 250 ms; between refreshes, back-to-back picks would all see
the same free KV and pile onto one worker. So each placement reserves its footprint on its worker at once:

- ``kv`` = prompt + expected output tokens, and ``prefill`` = prompt tokens, until the agent read the
  worker's metrics ``settle_s`` after the placement (``metrics_at``; ``updated_at`` for a worker without an
  agent): the engine has admitted the request and the usage numbers include it;
- after that, the expected output stays reserved as decode room until the request's stream ends: a stream
  (in particular a long-lived SSE one) keeps growing its KV while the record shows only what it holds now.

Everything is released at stream end. Reservations are per replica; other replicas' placements show once
the agent reports them.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.snapshot import FleetSnapshot


class Reservation:
    __slots__ = ("decode_tokens", "kv_tokens", "placed_at", "prefill_tokens", "worker_id")

    def __init__(self, worker_id: str, kv_tokens: int, prefill_tokens: int, decode_tokens: int,
                 placed_at: float) -> None:
        self.worker_id = worker_id
        self.kv_tokens = kv_tokens
        """What this reservation counts now on its worker (the whole footprint, then only the decode room)."""
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens
        self.placed_at = placed_at


class ReservationBook:
    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._unsettled: set[Reservation] = set()
        self._kv: dict[str, int] = {}
        self._prefill: dict[str, int] = {}

    @property
    def kv_tokens(self) -> Mapping[str, int]:
        """Worker id → reserved KV tokens (what a pick reads)."""
        return self._kv

    @property
    def prefill_tokens(self) -> Mapping[str, int]:
        """Worker id → placed prompt tokens the record does not show yet."""
        return self._prefill

    def reserve(self, worker_id: str, prompt_tokens: int, output_tokens: int, placed_at: float) -> Reservation:
        reservation = Reservation(worker_id, prompt_tokens + output_tokens, prompt_tokens, output_tokens,
                                  placed_at)
        self._add(worker_id, reservation.kv_tokens, prompt_tokens)
        self._unsettled.add(reservation)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """The request's stream ended; safe to call twice."""
        self._add(reservation.worker_id, -reservation.kv_tokens, -reservation.prefill_tokens)
        reservation.kv_tokens = reservation.prefill_tokens = 0
        self._unsettled.discard(reservation)

    def settle(self, snapshot: FleetSnapshot) -> None:
        """Shrink reservations to their decode room once the worker's facts are newer than placement + settle."""
        if not self._unsettled:
            return
        by_id = snapshot.by_id
        settle_s = self.settle_s
        for reservation in list(self._unsettled):
            worker = by_id.get(reservation.worker_id)
            if worker is None or (worker.metrics_at or worker.updated_at) < reservation.placed_at + settle_s:
                continue
            self._add(reservation.worker_id, reservation.decode_tokens - reservation.kv_tokens,
                      -reservation.prefill_tokens)
            reservation.kv_tokens = reservation.decode_tokens
            reservation.prefill_tokens = 0
            self._unsettled.discard(reservation)

    def _add(self, worker_id: str, kv_delta: int, prefill_delta: int) -> None:
        kv = self._kv.get(worker_id, 0) + kv_delta
        prefill = self._prefill.get(worker_id, 0) + prefill_delta
        if kv:
            self._kv[worker_id] = kv
        else:
            self._kv.pop(worker_id, None)
        if prefill:
            self._prefill[worker_id] = prefill
        else:
            self._prefill.pop(worker_id, None)
