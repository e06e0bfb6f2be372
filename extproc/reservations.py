"""Optimistic KV and prefill accounting for what this replica placed but the fleet records do not show yet.

The agent refreshes a worker's record every ≤ 250 ms; between refreshes, back-to-back picks would all see
the same free KV and pile onto one worker. So each placement reserves its footprint on its worker at once:

- ``kv`` = prompt + expected output tokens, and ``prefill`` = the prompt tokens not known to be cached
  there, until the agent read the worker's metrics ``settle_s`` after the placement (``metrics_at``; when
  it was last seen for a worker without an agent): the engine has admitted the request and the usage numbers
  include it;
- after that, the expected output stays reserved as decode room until the request's stream ends: a stream
  (in particular a long-lived SSE one) keeps growing its KV while the record shows only what it holds now.

Everything is released at stream end. Other replicas' reservations come from Redis (``extproc/peers.py``,
folded in with ``apply_peers``), and so that replicas picking at the same moment cannot each promise the same
free room, a replica may use only its share of the room nobody has reserved yet (``settle``):

    headroom(w) = capacity × (1 − kv_reserve_fraction − usage) − own(w) − others(w)
    held back   = headroom(w) × (replicas − 1) / replicas       (fixed until the next settle)

settled again on a new snapshot and whenever the others' reservations changed, so N replicas together place
at most the whole headroom between two refreshes, and each sees the others' placements at its next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
    def __init__(self, settle_s: float, reserve_fraction: float = 0.0) -> None:
        self.settle_s = settle_s
        self.reserve_fraction = reserve_fraction
        self._unsettled: set[Reservation] = set()
        self._kv: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._peer_kv: Mapping[str, int] = {}
        self._peer_prefill: Mapping[str, int] = {}
        self._replicas = 1
        self._view_kv: dict[str, int] = {}
        self._view_prefill: dict[str, int] = {}
        self._settled: tuple[FleetSnapshot, Mapping[str, int], int] | None = None
        """The snapshot, the other replicas' reservations and the replica count the view was last settled on."""
        self._own_moved: set[str] = set()
        """Workers whose reservations here changed since the last ``settle``."""
        self.peers_moved = False
        """The other replicas' reservations changed since the last ``settle``: the pick must settle again
        even if the fleet snapshot did not change."""

    @property
    def kv_tokens(self) -> Mapping[str, int]:
        """Worker id → KV tokens a pick must treat as taken: this replica's, the other replicas' and the
        other replicas' share of the free room (what a pick reads)."""
        return self._view_kv

    @property
    def prefill_tokens(self) -> Mapping[str, int]:
        """Worker id → placed prompt tokens the record does not show yet (this and other replicas)."""
        return self._view_prefill

    @property
    def own_kv_tokens(self) -> Mapping[str, int]:
        """This replica's reservations alone (what it publishes)."""
        return self._kv

    @property
    def own_prefill_tokens(self) -> Mapping[str, int]:
        return self._prefill

    def apply_peers(self, kv: Mapping[str, int], prefill: Mapping[str, int], replicas: int) -> None:
        """The other replicas' reservations and how many replicas share the fleet (this one included); the
        pick sees them from the next ``settle``, due at once when they changed (``peers_moved``)."""
        if (kv, prefill, max(1, replicas)) != (self._peer_kv, self._peer_prefill, self._replicas):
            self._peer_kv, self._peer_prefill, self._replicas = kv, prefill, max(1, replicas)
            self.peers_moved = True

    def reserve(self, worker_id: str, prompt_tokens: int, output_tokens: int, placed_at: float,
                prefill_tokens: int | None = None) -> Reservation:
        """``prefill_tokens``: the prompt part the worker must compute (default: all of it; less where its
        cache is known to hold the rest)."""
        prefill = prompt_tokens if prefill_tokens is None else prefill_tokens
        reservation = Reservation(worker_id, prompt_tokens + output_tokens, prefill, output_tokens, placed_at)
        self._add(worker_id, reservation.kv_tokens, prefill)
        self._unsettled.add(reservation)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """The request's stream ended; safe to call twice."""
        self._add(reservation.worker_id, -reservation.kv_tokens, -reservation.prefill_tokens)
        reservation.kv_tokens = reservation.prefill_tokens = 0
        self._unsettled.discard(reservation)

    def settle(self, snapshot: FleetSnapshot) -> None:
        """Shrink reservations to their decode room once the worker's facts are newer than placement + settle;
        then bring the pick's view up to date with the other replicas' reservations and their share of the
        room. Only the workers whose record, reservations here or elsewhere changed since the last settle are
        worked out again (all of them when the number of replicas changed): a settle costs what changed."""
        self._settle(snapshot)
        self.peers_moved = False
        settled, self._settled = self._settled, (snapshot, self._peer_kv, self._replicas)
        if settled is None or settled[2] != self._replicas:
            self._view_kv = {}
            moved: Iterable[str] = {*snapshot.by_id, *self._kv, *self._peer_kv}
        else:
            before, peers_before, _ = settled
            moved = (snapshot.by_id.changed_since(before.by_id) | self._own_moved
                     | {w for w in {*peers_before, *self._peer_kv} if peers_before.get(w) != self._peer_kv.get(w)})
        self._own_moved = set()
        others = (self._replicas - 1) / self._replicas
        usable = 1.0 - self.reserve_fraction
        by_id = snapshot.by_id
        for worker_id in moved:
            taken = self._kv.get(worker_id, 0) + self._peer_kv.get(worker_id, 0)
            worker = by_id.get(worker_id)
            if others and worker is not None and worker.kv_capacity_tokens > 0:
                headroom = worker.kv_capacity_tokens * (usable - worker.kv_usage) - taken
                if headroom > 0:
                    taken += int(headroom * others)
            if taken:
                self._view_kv[worker_id] = taken
            else:
                self._view_kv.pop(worker_id, None)
        self._view_prefill = _merged(self._peer_prefill, self._prefill)

    def _settle(self, snapshot: FleetSnapshot) -> None:
        if not self._unsettled:
            return
        by_id = snapshot.by_id
        settle_s = self.settle_s
        for reservation in list(self._unsettled):
            worker = by_id.get(reservation.worker_id)
            if worker is None or (worker.metrics_at or snapshot.seen_at(worker)) < reservation.placed_at + settle_s:
                continue
            self._add(reservation.worker_id, reservation.decode_tokens - reservation.kv_tokens,
                      -reservation.prefill_tokens)
            reservation.kv_tokens = reservation.decode_tokens
            reservation.prefill_tokens = 0
            self._unsettled.discard(reservation)

    def _add(self, worker_id: str, kv_delta: int, prefill_delta: int) -> None:
        self._own_moved.add(worker_id)
        _bump(self._kv, worker_id, kv_delta)
        _bump(self._prefill, worker_id, prefill_delta)
        _bump(self._view_kv, worker_id, kv_delta)
        _bump(self._view_prefill, worker_id, prefill_delta)


def _bump(counts: dict[str, int], worker_id: str, delta: int) -> None:
    value = counts.get(worker_id, 0) + delta
    if value:
        counts[worker_id] = value
    else:
        counts.pop(worker_id, None)


def _merged(base: Mapping[str, int], own: Mapping[str, int]) -> dict[str, int]:
    merged = dict(base)
    for worker_id, tokens in own.items():
        merged[worker_id] = merged.get(worker_id, 0) + tokens
    return merged
