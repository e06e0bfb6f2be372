"""Optimistic KV and prefill accounting for what this replica placed but the fleet records do not show yet.

The agent refreshes a worker's record every ≤ 250 ms; between refreshes, back-to-back picks would all see
the same free KV and pile onto one worker. So each placement reserves its footprint on its worker at once:

- ``kv`` = prompt + expected output tokens, and ``prefill`` = the prompt tokens not known to be cached
  there, until the agent read the worker's metrics ``settle_s`` after the placement (``metrics_at``; when
  it was last seen for a worker without an agent): the engine has admitted the request and the usage numbers
  include it;
- after that, the part of the expected output the stream has not written yet stays reserved as decode room:
  a stream (in particular a long-lived SSE one) keeps growing its KV while the record shows only what it
  holds now. It writes one token per inter-token gap of its worker (``inter_token_s``, the agent's moving
  average of vLLM's histogram) from its first token on, expected one time to first token
  (``ttft_ewma_s``, at least ``settle_s``) after its placement:

      decode(t) = max(0, expected output − (t_r − placed_at − max(settle_s, ttft)) / inter_token_s)

  with t_r when the record's usage was read (``metrics_at``): the usage holds what the stream wrote until
  then, not since (counting up to now left the tokens written since the reading nowhere: neither in the
  usage nor in the room kept, so a late record promised them as free). Worked out again
  whenever the worker's record changes (every scrape while it serves); while its worker's
  inter-token gap is unknown, the whole expected output stays reserved;
- and what a worker's streams hold back together is the peak of their growth, not the sum of their decode
  rooms: they write one token each per engine step, so by the time the longest has written its room the
  shorter ones have ended and freed their own blocks. With the n streams ordered by decode room d_1 ≤ … ≤ d_n
  and f_j = the prompt tokens stream j computed there plus what it has written (freed with its room when it
  ends):

      peak = max over k of ( (n − k + 1) × d_k − Σ_{j<k} f_j )      (≤ Σ d_k, and ≥ d_n − Σ_{j<n} f_j)

  The difference from the sum is the worker's decode credit, taken off the reservations there.

Everything is released at stream end.

Why the decode room shrinks: the record's usage already holds what an open stream has written, so keeping
its whole expected output (the p95 of its class: ``output_lengths``) until the stream ended counted prompt +
written + expected, and on six L4s serving multi-turn sessions two dozen streams held back half a cache that
no stream ever filled: the virtual-time lab (``bench lab``, bursts at 85 %) gave p99 2.39 s against 0.44 s
with it shrinking, and at 100 % 62 requests held 5 s and refused while every engine was half free (6 with
the rooms shrinking, none with the peak: p99 0.525 s against least-request's 0.926 s). Dropping
the decode room outright at the settle did as well in those cells and is wrong: a worker whose streams have
most of their output still to write looks free, and requests placed there are preempted when the streams
grow (``tests/integration/test_extproc_queue_order.py`` holds this).

Several replicas (extproc processes, nodes) place on the same workers. Each publishes its reservations and
reads the others' through Redis (``extproc/peers.py``, folded in with ``apply_peers``): a placement reaches
another replica's pick at most one flush batch (20 ms) plus one refresh (``snapshot_refresh_s``, 100 ms)
plus the round trips later, ~120 ms; ``exchange_s`` (140 ms by default, set from the configuration) is that
bound with a margin. Processes of one host also tell each other at once (``siblings``): while every live
replica is one of them, ``exchange_s`` is ``siblings.SIBLING_EXCHANGE_S`` (5 ms). Within it, replicas
placing at once could each promise the same free room, so each holds back the others' share of it, except
in its turn on the worker:

    free(w)     = capacity × (1 − kv_reserve_fraction − usage) − own(w) − others(w)
    recent(w)   = what this replica placed on w in the last ``exchange_s`` (the others may not see it yet)
    share(w)    = (free(w) + recent(w)) / replicas
    held back   = 0                                      in its turn on w, while recent(w) ≤ share(w)
                = free(w) × (replicas − 1) / replicas    otherwise (fixed until the next settle)
    kv_tokens(w) = own(w) + others(w) + held back          (what a pick treats as taken)

and a placement in its turn that takes recent(w) past share(w) closes w to this replica (everything free
held back) until the next settle. Settled again on a new snapshot, whenever the others' reservations changed,
and when a turn opens or closes or a recent placement is ``exchange_s`` old (``apply_peers(at=…)`` raises
``peers_moved``).

Turns need no messages: time is cut into turns of ``4 × exchange_s`` (560 ms); in turn k the replica of rank
(k + crc32(w)) mod replicas (ranks: the live replica ids in sorted order, the same list everywhere) holds w's
turn during the first half, nobody during the second, so a claim made at the end of one turn is read by every
replica (one ``exchange_s``) and in its view (one refresh more) before the next turn opens. At any moment a
replica holds the turn on ~1/(2 × replicas) of the workers, a different part each turn.

What this gives:
- a request that fits a worker's free room is placed there at the latest in the next turn of the replica
  its stream reached (every ``replicas × 4 × exchange_s``: 1.1 s for two replicas; on a larger fleet some
  worker's turn comes sooner): never refused because the room was split N ways. Before, each replica could
  promise only 1/N of the unreserved room, always: a 14k-token prompt fitted an L4 behind two processes
  only when the worker was ~80 % free, and was held until its wait bound, then refused;
- requests that fit a replica's share are placed as before, at once;
- the turn holder's promises past its share are one request per turn: the replicas' unseen promises on a
  worker exceed its free room by at most that request (before: by at most a fraction of a request as each
  replica took a share of what was left at each settle). A burst of small requests over four processes at
  one small worker still causes no preemption (``tests/integration/test_extproc_processes.py``);
- alone (``replicas`` = 1), the whole free room, always.

Dropping the split outright (every replica the whole room at all times) would be simpler and is not safe:
when several replicas hold requests at once, as in a burst or at saturation, where a freed worker appears in
every replica's snapshot at the same refresh, each fills the same room within one exchange, N times over.
Measured on that burst (200 requests, four processes, one 4,096-token worker): 22 preemptions, against none
with the split and none with turns.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Iterable, Mapping

from extproc.prefill_ledger import Unsettled
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.fleet import WorkerRecord

EXCHANGE_S = 0.14
"""How long a placement may stay unseen by the other replicas: the flush batch window (20 ms), one refresh
period (``extproc.snapshot_refresh_s``, 100 ms by default) and the round trips, with a margin."""
TURNS_PER_EXCHANGE = 4
"""A turn lasts this many ``exchange_s``; its first half is the claim window, its second the guard."""
PEER_PLACED_KEPT_S = 60.0
"""How long the other replicas' placements wait for this replica's next pick: any prefill read this long ago
is done at any rate, and a replica that picks nothing keeps no growing list."""


class Reservation:
    __slots__ = ("computed_tokens", "decode_tokens", "kv_tokens", "placed_at", "prefill_tokens", "worker_id")

    def __init__(self, worker_id: str, kv_tokens: int, prefill_tokens: int, decode_tokens: int,
                 placed_at: float) -> None:
        self.worker_id = worker_id
        self.kv_tokens = kv_tokens
        """What this reservation counts now on its worker (the whole footprint, then the decode room left)."""
        self.prefill_tokens = prefill_tokens
        """The prompt tokens the worker computes for it, until the record shows the placement."""
        self.computed_tokens = prefill_tokens
        """The same, kept: its own blocks, which its worker frees when the stream ends."""
        self.decode_tokens = decode_tokens
        self.placed_at = placed_at


class ReservationBook:
    def __init__(self, settle_s: float, reserve_fraction: float = 0.0, exchange_s: float = EXCHANGE_S) -> None:
        self.settle_s = settle_s
        self.reserve_fraction = reserve_fraction
        self.exchange_s = exchange_s
        """How long a placement here may stay unseen by the other replicas (the exchange's delay bound)."""
        self._unsettled: set[Reservation] = set()
        self._unsettled_requests: dict[str, int] = {}
        """Worker id → how many of this replica's reservations there are unsettled (published with their
        prefill: the others' ledgers count them as that many requests)."""
        self._kv: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._peer_kv: Mapping[str, int] = {}
        self._peer_prefill: Mapping[str, int] = {}
        self._replicas = 1
        self._rank = 0
        self._recent: deque[tuple[float, str, int]] = deque()
        """(placed at, worker, KV tokens) of the placements of the last ``exchange_s``, oldest first."""
        self._recent_kv: dict[str, int] = {}
        self._now = float("-inf")
        """The latest time the exchange reported (``apply_peers``); a settle also reads the snapshot's."""
        self._turn: tuple[int, bool] = (0, False)
        """The turn and whether its claim window is open, at the last settle."""
        self._claiming: set[str] = set()
        """Workers on which this replica holds the turn and may still promise the whole free room."""
        self._view_kv: dict[str, int] = {}
        self._view_prefill: dict[str, int] = {}
        self._settled: tuple[FleetSnapshot, Mapping[str, int], int, int] | None = None
        """The snapshot, the other replicas' reservations, the replica count and this replica's rank the view
        was last settled on."""
        self._own_moved: set[str] = set()
        """Workers whose reservations here changed since the last ``settle``."""
        self.peers_moved = False
        """The other replicas' reservations, the turn or this replica's recent placements changed since the
        last ``settle``: the pick must settle again even if the fleet snapshot did not change."""
        self._peer_placed: list[tuple[str, Unsettled, float | None]] = []
        """(Worker id, the prefill the other replicas placed there, when that was read), in the order read,
        since ``take_peer_placements``."""
        self._decoding: dict[str, dict[Reservation, float]] = {}
        """Worker id → its settled reservations whose decode room is still shrinking → when the stream's
        first token was expected."""
        self._decode_credit: dict[str, int] = {}
        """Worker id → how much less than the sum of its streams' decode rooms the peak of their growth is
        (``_reprice``), taken off this replica's reservations there."""

    @property
    def kv_tokens(self) -> Mapping[str, int]:
        """Worker id → KV tokens a pick must treat as taken: this replica's, the other replicas' and the room
        it leaves to the others (their share of the free room, except in its turn; what a pick reads)."""
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

    def own_reservations(self, workers: Iterable[str] | None = None) -> dict[str, tuple[int, int, int]]:
        """Worker id → this replica's (KV, prefill, unsettled requests) there, on ``workers`` (default: where
        it holds any): what it tells the other replicas."""
        kv, prefill, requests = self._kv, self._prefill, self._unsettled_requests
        return {w: (kv.get(w, 0), prefill.get(w, 0), requests.get(w, 0))
                for w in (workers if workers is not None else {*kv, *prefill, *requests})}

    def apply_peers(self, kv: Mapping[str, int], prefill: Mapping[str, int], replicas: int, rank: int = 0,
                    at: float | None = None, placed: Mapping[str, Unsettled] | None = None) -> None:
        """The other replicas' reservations, how many replicas share the fleet (this one included), this
        replica's rank among them (its index in the sorted list of live replica ids) and the time of the read;
        the pick sees them from the next ``settle``, due at once (``peers_moved``) when they changed, when a
        turn began or its claim window closed, or when a recent placement here has surely been seen.
        ``placed``: the prefill they placed on each worker since the last read (``prefill_ledger.placed_since``),
        kept for the ledger until ``take_peer_placements``."""
        kept = self._peer_placed
        kept.extend((worker_id, news, at) for worker_id, news in (placed or {}).items())
        if at is not None and kept and (first := kept[0][2]) is not None and first < at - PEER_PLACED_KEPT_S:
            self._peer_placed = [read for read in kept if read[2] is None or read[2] >= at - PEER_PLACED_KEPT_S]
        replicas = max(1, replicas)
        rank = min(max(0, rank), replicas - 1)
        if (kv, prefill, replicas, rank) != (self._peer_kv, self._peer_prefill, self._replicas, self._rank):
            self._peer_kv, self._peer_prefill, self._replicas, self._rank = kv, prefill, replicas, rank
            self.peers_moved = True
        if at is not None:
            self._now = max(self._now, at)
            if replicas > 1 and (self._turn_at(self._now) != self._turn
                                 or (self._recent and self._recent[0][0] + self.exchange_s <= self._now)):
                self.peers_moved = True

    def take_peer_placements(self) -> list[tuple[str, Unsettled, float | None]]:
        """(Worker id, prefill tokens and requests, when read) of what the other replicas placed since the last
        call, in the order read (for the prefill ledger, which drains it as this replica's own from when it was
        read: a replica that picks nothing for a while must not find it all still queued at its next pick)."""
        placed, self._peer_placed = self._peer_placed, []
        return placed

    def reserve(self, worker_id: str, prompt_tokens: int, output_tokens: int, placed_at: float,
                prefill_tokens: int | None = None) -> Reservation:
        """``prefill_tokens``: the prompt part the worker must compute (default: all of it; less where its
        cache is known to hold the rest)."""
        prefill = prompt_tokens if prefill_tokens is None else prefill_tokens
        reservation = Reservation(worker_id, prompt_tokens + output_tokens, prefill, output_tokens, placed_at)
        self._recent.append((placed_at, worker_id, reservation.kv_tokens))
        _bump(self._recent_kv, worker_id, reservation.kv_tokens)
        self._add(worker_id, reservation.kv_tokens, prefill)
        self._unsettled.add(reservation)
        _bump(self._unsettled_requests, worker_id, 1)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """The request's stream ended; safe to call twice. (A recent placement keeps counting against this
        replica's share until it ages out: the others may have seen it and not yet its release.)"""
        self._add(reservation.worker_id, -reservation.kv_tokens, -reservation.prefill_tokens)
        reservation.kv_tokens = reservation.prefill_tokens = 0
        if reservation in self._unsettled:
            self._unsettled.discard(reservation)
            _bump(self._unsettled_requests, reservation.worker_id, -1)
        streams = self._decoding.get(reservation.worker_id)
        if streams is not None and streams.pop(reservation, None) is not None:
            self._reprice(reservation.worker_id)

    def settle(self, snapshot: FleetSnapshot) -> None:
        """Shrink reservations to their decode room once the worker's facts are newer than placement + settle,
        and decode rooms by what their streams wrote since (on the workers whose record changed); then bring
        the pick's view up to date with the other replicas' reservations, this replica's recent placements and
        its turns. Only the workers whose record, reservations here or elsewhere, recent placements or turn
        changed since the last settle are worked out again (all of them when the number of replicas or this
        replica's rank changed): a settle costs what changed, and a turn's change a cheap pass over the
        fleet."""
        now = max(self._now, snapshot.taken_at)
        settled = self._settled
        changed = None if settled is None else snapshot.by_id.changed_since(settled[0].by_id)
        self._settle(snapshot)
        self._shrink_decode_rooms(snapshot, now, changed)
        self._age(now)
        self.peers_moved = False
        turn, self._turn = self._turn, self._turn_at(now)
        self._settled = (snapshot, self._peer_kv, self._replicas, self._rank)
        if settled is None or settled[2:] != (self._replicas, self._rank):
            self._view_kv = {}
            self._claiming = set()
            moved: Iterable[str] = {*snapshot.by_id, *self._kv, *self._peer_kv}
        else:
            peers_before = settled[1]
            assert changed is not None
            moved = (changed | self._own_moved
                     | {w for w in {*peers_before, *self._peer_kv} if peers_before.get(w) != self._peer_kv.get(w)})
            if turn != self._turn and self._replicas > 1:
                moved |= {w for w in snapshot.by_id if self._holds(w, turn) != self._holds(w, self._turn)}
        self._own_moved = set()
        by_id = snapshot.by_id
        for worker_id in moved:
            self._set_view(worker_id, by_id.get(worker_id))
        self._view_prefill = _merged(self._peer_prefill, self._prefill)

    def _set_view(self, worker_id: str, worker: WorkerRecord | None) -> None:
        """The KV tokens a pick treats as taken on the worker (the formula in the module docstring)."""
        taken = self._kv.get(worker_id, 0) + self._peer_kv.get(worker_id, 0)
        self._claiming.discard(worker_id)
        free = self._free(worker_id, worker, taken)
        if free > 0:
            if self._holds(worker_id, self._turn) and self._within_share(worker_id, free):
                self._claiming.add(worker_id)
            else:
                taken += int(free * (self._replicas - 1) / self._replicas)
        if taken:
            self._view_kv[worker_id] = taken
        else:
            self._view_kv.pop(worker_id, None)

    def _free(self, worker_id: str, worker: WorkerRecord | None, taken: int) -> float:
        """The worker's free room nobody reserved (0 when alone or its capacity is unknown: nothing held back)."""
        if self._replicas == 1 or worker is None or worker.kv_capacity_tokens <= 0:
            return 0.0
        return worker.kv_capacity_tokens * (1.0 - self.reserve_fraction - worker.kv_usage) - taken

    def _within_share(self, worker_id: str, free: float) -> bool:
        """What this replica placed on the worker in the last ``exchange_s`` is within its share of the room
        the others last saw."""
        recent = self._recent_kv.get(worker_id, 0)
        return recent <= (free + recent) / self._replicas

    def _turn_at(self, now: float) -> tuple[int, bool]:
        """The turn at ``now`` and whether its claim window (the first half) is open."""
        turn_s = TURNS_PER_EXCHANGE * self.exchange_s
        index = math.floor(now / turn_s) if math.isfinite(now) else 0
        return index, now - index * turn_s < turn_s / 2

    def _holds(self, worker_id: str, turn: tuple[int, bool]) -> bool:
        """Whether this replica holds the worker's turn (the claim window open, and its rank's turn)."""
        index, open_ = turn
        return open_ and (index + zlib.crc32(worker_id.encode())) % self._replicas == self._rank

    def _age(self, now: float) -> None:
        """Forget the placements older than ``exchange_s`` at ``now``: the others have seen them."""
        recent = self._recent
        horizon = now - self.exchange_s
        while recent and recent[0][0] <= horizon:
            _, worker_id, kv_tokens = recent.popleft()
            _bump(self._recent_kv, worker_id, -kv_tokens)
            self._own_moved.add(worker_id)

    def _settle(self, snapshot: FleetSnapshot) -> None:
        if not self._unsettled:
            return
        by_id = snapshot.by_id
        settle_s = self.settle_s
        decoding_more: set[str] = set()
        for reservation in list(self._unsettled):
            worker = by_id.get(reservation.worker_id)
            if worker is None or _read_at(worker, snapshot) < reservation.placed_at + settle_s:
                continue
            self._add(reservation.worker_id, reservation.decode_tokens - reservation.kv_tokens,
                      -reservation.prefill_tokens)
            reservation.kv_tokens = reservation.decode_tokens
            reservation.prefill_tokens = 0
            self._unsettled.discard(reservation)
            _bump(self._unsettled_requests, reservation.worker_id, -1)
            if reservation.decode_tokens:
                writes_from = reservation.placed_at + max(settle_s, worker.ttft_ewma_s)
                self._decoding.setdefault(reservation.worker_id, {})[reservation] = writes_from
                decoding_more.add(reservation.worker_id)
        for worker_id in decoding_more:  # once per worker, however many of its streams settled together
            self._reprice(worker_id)

    def _shrink_decode_rooms(self, snapshot: FleetSnapshot, now: float, changed: set[str] | None) -> None:
        """Shrink the decode room of the streams on the workers whose record changed (``None``: every worker)
        by what they have written since their first token (the module docstring's ``decode(t)``)."""
        decoding = self._decoding
        if not decoding:
            return
        by_id = snapshot.by_id
        workers = [w for w in decoding if changed is None or w in changed]
        for worker_id in workers:
            worker = by_id.get(worker_id)
            if worker is None or worker.inter_token_s <= 0:
                continue
            gap = worker.inter_token_s
            # Written by when the record's usage was read (it holds those tokens), not by now: what the streams
            # wrote since stays reserved until a record shows it.
            read_at = min(now, _read_at(worker, snapshot))
            streams = decoding[worker_id]
            for reservation, writes_from in list(streams.items()):
                left = max(0, reservation.decode_tokens - int(max(0.0, read_at - writes_from) / gap))
                if left != reservation.kv_tokens:
                    self._add(worker_id, left - reservation.kv_tokens, 0)
                    reservation.kv_tokens = left
                if not left:
                    del streams[reservation]
            self._reprice(worker_id)

    def _reprice(self, worker_id: str) -> None:
        """Count the peak of the worker's streams' growth instead of the sum of their decode rooms (the
        module docstring's ``peak``): the difference is this worker's decode credit."""
        streams = self._decoding.get(worker_id)
        credit = 0
        if streams:
            ordered = sorted(streams, key=_decode_room)
            total = peak = freed = 0
            remaining = len(ordered)
            for reservation in ordered:
                left = reservation.kv_tokens
                total += left
                peak = max(peak, remaining * left - freed)
                freed += reservation.computed_tokens + reservation.decode_tokens - left
                remaining -= 1
            credit = total - peak
        else:
            self._decoding.pop(worker_id, None)
        before = self._decode_credit.get(worker_id, 0)
        if credit != before:
            self._add(worker_id, before - credit, 0)
            if credit:
                self._decode_credit[worker_id] = credit
            else:
                del self._decode_credit[worker_id]

    def _add(self, worker_id: str, kv_delta: int, prefill_delta: int) -> None:
        self._own_moved.add(worker_id)
        _bump(self._kv, worker_id, kv_delta)
        _bump(self._prefill, worker_id, prefill_delta)
        _bump(self._view_kv, worker_id, kv_delta)
        _bump(self._view_prefill, worker_id, prefill_delta)
        if kv_delta > 0 and worker_id in self._claiming and self._settled is not None:
            taken = self._kv.get(worker_id, 0) + self._peer_kv.get(worker_id, 0)
            free = self._free(worker_id, self._settled[0].by_id.get(worker_id), taken)
            if not self._within_share(worker_id, free):  # its claim crossed its share: no more until seen
                self._claiming.discard(worker_id)
                _bump(self._view_kv, worker_id, max(0, int(free)))


def _read_at(worker: WorkerRecord, snapshot: FleetSnapshot) -> float:
    """When the worker's usage in the snapshot was read: its engine's scrape, else when the record arrived."""
    return worker.metrics_at or snapshot.seen_at(worker)


def _decode_room(reservation: Reservation) -> int:
    return reservation.kv_tokens


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
