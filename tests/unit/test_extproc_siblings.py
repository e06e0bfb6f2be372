"""The extproc processes of one host tell each other every placement at once: over real local datagram
sockets, a sibling's reservation, in-flight request and the prompt blocks it made pending are in this
process's view before its next pick, and what Redis holds of the sibling is not counted a second time."""

from __future__ import annotations

import itertools
import os

from extproc.affinity import AffinityMap
from extproc.inflight import InflightTracker
from extproc.kvcache.index import PrefixIndex
from extproc.peers import PeerExchange, PeerKeys
from extproc.reservations import ReservationBook
from extproc.siblings import (
    BEAT_S,
    SIBLING_EXCHANGE_S,
    SILENT_S,
    News,
    Outbox,
    Placed,
    Siblings,
    SiblingSocket,
    SiblingView,
    decode,
    encode,
    own_state,
    sibling_ports,
)
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord

POOLS = (PoolSpec(name="chat", model="llama"),)
_ports = itertools.count(40_000 + os.getpid() % 10_000 * 2)


def snapshot(at: float = 100.0) -> FleetSnapshot:
    records = [WorkerRecord(id=w, pool="chat", model="llama", host="h", port=1, updated_at=at, metrics_at=at,
                            kv_capacity_tokens=100_000, kv_usage=0.0) for w in ("w1", "w2")]
    return build_snapshot(records, POOLS, taken_at=at, stale_after_s=3.0)


class Process:
    """One extproc process's parts that siblings touch, wired as ``extproc.server`` wires them."""

    def __init__(self, replica_id: str, port: int, ports: tuple[int, ...], clock: list[float]) -> None:
        self.book = ReservationBook(settle_s=0.5)
        self.inflight = InflightTracker()
        self.affinity = AffinityMap(1000)
        self.index = PrefixIndex(pending_s=2.0)
        for worker_id in ("w1", "w2"):  # both publish KV events: subscribed, in sync
            self.index.mark_known(worker_id)
        self.siblings = Siblings(replica_id, SiblingSocket(port, ports), own_state(self.book, self.inflight),
                                 clock=lambda: clock[0])
        self.peers = PeerExchange(PeerKeys("t"), replica_id, self.book, clock=lambda: clock[0],
                                  affinity=self.affinity, siblings=self.siblings)

        def placed(news: Placed) -> None:
            self.index.add_pending(news.worker_id, news.pending_keys, clock[0])
            self.affinity.apply(news.affinity)

        def changed() -> None:
            self.peers.merge()
            self.inflight.apply_siblings(*self.siblings.view.inflight())

        self.siblings.on_placed = placed
        self.siblings.on_change = changed

    def place(self, worker_id: str, prompt_tokens: int, keys: list[int], at: float) -> None:
        """What ``Place.commit`` does, then tells the siblings."""
        self.book.reserve(worker_id, prompt_tokens, 100, at)
        self.inflight.acquire(worker_id)
        self.index.add_pending(worker_id, keys, at)
        self.affinity.record(["session-1"], worker_id)
        self.siblings.placed(worker_id, keys, [("session-1", worker_id)])
        self.siblings.send([worker_id])

    def close(self) -> None:
        self.siblings.close()


def pair(clock: list[float]) -> tuple[Process, Process]:
    ports = (next(_ports), next(_ports))
    return Process("a", ports[0], ports, clock), Process("b", ports[1], ports, clock)


def test_a_siblings_placement_is_in_the_view_before_the_next_pick() -> None:
    clock = [100.0]
    a, b = pair(clock)
    try:
        a.place("w1", 6_000, [11, 12, 13], at=100.0)
        b.siblings.receive()  # what Place.context() does before every pick
        b.book.settle(snapshot())
        assert b.book.prefill_tokens.get("w1") == 6_000
        assert b.book.kv_tokens.get("w1", 0) >= 6_100
        assert b.inflight.counts.get("w1") == 1
        assert b.affinity.entries.get("session-1") == "w1"
        held, held_or_pending = b.index.cached_prefixes([11, 12, 13, 14], ["w1", "w2"], 100.0)
        assert held_or_pending.get("w1") == 3 and not held.get("w1")
        assert b.peers.replicas == 2 and b.book.exchange_s == SIBLING_EXCHANGE_S
    finally:
        a.close()
        b.close()


def test_a_release_reaches_the_sibling_and_frees_the_room() -> None:
    clock = [100.0]
    a, b = pair(clock)
    try:
        a.book.reserve("w1", 6_000, 100, 100.0)
        a.inflight.acquire("w1")
        a.siblings.send()
        b.siblings.receive()
        assert b.inflight.counts.get("w1") == 1
        reservation = next(iter(a.book._unsettled))
        a.book.release(reservation)
        a.inflight.release("w1")
        a.siblings.send(["w1"])
        b.siblings.receive()
        b.book.settle(snapshot())
        assert not b.book.prefill_tokens.get("w1")
        assert b.inflight.counts.get("w1", 0) == 0
    finally:
        a.close()
        b.close()


def test_what_redis_holds_of_a_sibling_is_not_counted_twice() -> None:
    """B reads Redis: the sibling A's field (also told over the link) is left out, a replica on another host
    (C) is counted; C keeps the Redis exchange's window."""
    clock = [100.0]
    a, b = pair(clock)
    try:
        a.place("w1", 6_000, [1], at=100.0)
        b.siblings.receive()
        apply = b.peers.queue_reads(_Pipe(), {"w1": None, "w2": None})
        apply([{b"a": b"100.0", b"b": b"100.0", b"c": b"100.0"},
               {b"w1 a": b"6100 6000 100.0", b"w1 c": b"500 400 100.0"}, None])
        b.book.settle(snapshot())
        assert b.book.prefill_tokens.get("w1") == 6_000 + 400
        assert b.peers.replicas == 3
        assert b.book.exchange_s > SIBLING_EXCHANGE_S  # a replica elsewhere: Redis's bound again
    finally:
        a.close()
        b.close()


def test_in_flight_counts_replace_the_siblings_part_of_the_redis_total() -> None:
    tracker = InflightTracker()
    tracker.acquire("w1")
    tracker.mark_flushed(tracker.take_pending())
    # Redis: 1 own + 2 from sibling (both written) + 4 from elsewhere; the sibling now has 3 in flight.
    tracker.apply_remote({"w1": 7})
    tracker.apply_siblings({"w1": 3}, {"w1": 2})
    assert tracker.counts["w1"] == 1 + 3 + 4


def test_a_silent_sibling_is_forgotten_and_the_beat_repeats_everything() -> None:
    clock = [100.0]
    a, b = pair(clock)
    try:
        a.book.reserve("w1", 1_000, 0, 100.0)
        a.siblings.send()
        b.siblings.receive()
        assert b.siblings.ids == {"a"}
        clock[0] += BEAT_S
        a.siblings.send()  # nothing changed; the beat holds the whole state
        news = decode(_last(b))
        assert news is not None and news.whole and news.reservations == {"w1": (1_000, 1_000, 1)}
        clock[0] += SILENT_S + 1
        b.siblings.receive()
        assert b.siblings.ids == frozenset()
    finally:
        a.close()
        b.close()


def test_datagrams_round_trip_and_malformed_ones_are_skipped() -> None:
    news = News("a", {"w1": (10, 5, 1)}, {"w1": (1, 0)},
                [Placed("w1", [2**64 - 1, 7], [(("s", "t"), "w1"), ("doc", "w1")])], whole=False)
    assert decode(encode(news)) == news
    assert decode(b"not json") is None
    assert decode(b'["a", false, {"w1": 3}, {}, []]') is None


def test_only_changes_travel_and_a_removed_reservation_travels_as_zero() -> None:
    outbox = Outbox()
    first = outbox.news("a", ({"w1": (10, 5, 1)}, {}), [], whole=False)
    assert first is not None and first.reservations == {"w1": (10, 5, 1)}
    assert outbox.news("a", ({"w1": (10, 5, 1)}, {}), [], whole=False) is None
    other = outbox.news("a", ({"w2": (3, 3, 1)}, {"w2": (1, 0)}), [], whole=False, only=["w2"])
    assert other is not None and other.reservations == {"w2": (3, 3, 1)}  # w1 not looked at: not gone
    gone = outbox.news("a", ({}, {}), [], whole=False)
    assert gone is not None and gone.reservations == {"w1": (0, 0, 0), "w2": (0, 0, 0)}
    assert gone.inflight == {"w2": (0, 0)}
    view = SiblingView()
    for news in (first, other, gone):
        view.take(news, 1.0)
    assert list(view.reservations()) == []


def test_a_sibling_not_started_yet_costs_nothing() -> None:
    ports = (next(_ports), next(_ports))
    alone = SiblingSocket(ports[0], ports)
    try:
        assert alone.send(b"x") == 0
        assert alone.receive() == []
    finally:
        alone.close()


def test_the_command_line_list_of_ports() -> None:
    assert sibling_ports("5001, 5002") == (5001, 5002)
    assert sibling_ports(None) == ()


class _Pipe:
    """Records nothing: ``queue_reads`` only queues reads on it."""

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


def _last(process: Process) -> bytes:
    received = process.siblings._link.receive()
    assert received
    return received[-1]
