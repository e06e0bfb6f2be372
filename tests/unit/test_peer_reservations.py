"""KV reservations shared between extproc replicas: the book's view (the others' share of the free room held
back, except for one request past its share in a replica's turn on a worker), the exchange through a real
Redis (what one replica publishes, another reads; a dead one's fades), and the affinity records that make a
session or prompt prefix follow one worker across replicas."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from extproc.affinity import AffinityMap
from extproc.peers import PRESENCE_REFRESH_S, PRESENCE_TTL_S, PeerExchange, PeerKeys
from extproc.placed_prefixes import PlacedPrefixes
from extproc.prefill_ledger import Unsettled
from extproc.request import RequestFacts
from extproc.reservations import EXCHANGE_S, TURNS_PER_EXCHANGE, ReservationBook
from extproc.scheduling.estimate import prefix_keys
from extproc.snapshot import FleetIndex, FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord

POOLS = (PoolSpec(name="chat", model="llama"),)


def snapshot(usage: float = 0.0, at: float = 100.0) -> FleetSnapshot:
    record = WorkerRecord(id="w", pool="chat", model="llama", host="h", port=1, updated_at=at, metrics_at=at,
                          kv_capacity_tokens=10_000, kv_usage=usage)
    return build_snapshot([record], POOLS, taken_at=at, stale_after_s=3.0)


def test_alone_a_replica_may_use_all_the_free_room() -> None:
    book = ReservationBook(settle_s=0.5)
    book.settle(snapshot())
    assert book.kv_tokens == {}


def next_turn(worker_id: str, replicas: int, rank: int, after: float) -> float:
    """A moment inside the next claim window of ``rank`` on the worker after ``after`` (the documented rule:
    turns of ``4 × exchange_s``, rank (turn + crc32(worker)) mod replicas holds the first half)."""
    turn_s = TURNS_PER_EXCHANGE * EXCHANGE_S
    index = math.floor(after / turn_s) + 1
    while (index + zlib.crc32(worker_id.encode())) % replicas != rank:
        index += 1
    return index * turn_s + 0.01


def outside_turns(after: float) -> float:
    """A moment after ``after`` in the second half of a turn, where nobody holds any worker's turn."""
    turn_s = TURNS_PER_EXCHANGE * EXCHANGE_S
    return (math.floor(after / turn_s) + 1) * turn_s + turn_s * 0.75


def room(book: ReservationBook, free: int = 10_000) -> int:
    return free - book.kv_tokens.get("w", 0)


def test_a_prompt_needing_most_of_the_free_room_fits_either_of_two_replicas_in_its_turn() -> None:
    books = [ReservationBook(settle_s=0.5) for _ in range(2)]
    accepted_at: list[list[float]] = [[], []]
    turn_s = TURNS_PER_EXCHANGE * EXCHANGE_S
    for step in range(int(2 * 2 * turn_s / 0.01)):  # two replicas' turns, twice over
        now = 100.0 + step * 0.01
        for rank, book in enumerate(books):
            book.apply_peers({}, {}, replicas=2, rank=rank, at=now)
            book.settle(snapshot(at=now))  # free 10,000, nothing reserved anywhere
            if room(book) >= 7_000:
                accepted_at[rank].append(now)
            else:
                assert room(book) == 5_000  # outside its turn, its half
        assert not (accepted_at[0][-1:] == accepted_at[1][-1:] == [now])  # never both at the same moment
    assert accepted_at[0] and accepted_at[1]  # each replica takes it in its turn (1/2 split: never)
    for times in accepted_at:
        assert max(b - a for a, b in zip([100.0, *times], [*times, 100.0 + 4 * turn_s], strict=True)) <= 2 * turn_s


def test_alone_a_replica_takes_the_whole_room_at_any_time() -> None:
    book = ReservationBook(settle_s=0.5)
    book.apply_peers({}, {}, replicas=1, at=outside_turns(100.0))
    book.settle(snapshot(at=outside_turns(100.0)))
    book.reserve("w", 9_000, 500, placed_at=outside_turns(100.0))
    assert book.kv_tokens == {"w": 9_500}


def test_outside_its_turn_each_of_four_replicas_may_take_a_quarter_of_the_unreserved_room() -> None:
    book = ReservationBook(settle_s=0.5)
    book.apply_peers({"w": 2_000}, {"w": 500}, replicas=4)
    book.settle(snapshot(usage=0.2))  # free 8,000, of which others reserved 2,000: 6,000 unclaimed (at 100.0
    assert book.kv_tokens == {"w": 2_000 + 4_500}  # and 100.1 nobody holds a turn): the others' share held back
    assert book.prefill_tokens == {"w": 500}
    book.reserve("w", prompt_tokens=1_000, output_tokens=500, placed_at=100.0)  # 1,500 of its own 1,500
    assert book.kv_tokens == {"w": 8_000} and book.own_kv_tokens == {"w": 1_500}
    book.settle(snapshot(usage=0.2, at=100.1))  # next snapshot: a quarter of what is left unclaimed
    assert book.kv_tokens == {"w": 1_500 + 2_000 + 3_375}


def test_in_its_turn_a_replica_may_take_the_whole_room_for_one_request_past_its_share() -> None:
    now = next_turn("w", 4, 2, 100.0)
    book = ReservationBook(settle_s=5.0)
    book.apply_peers({"w": 2_000}, {}, replicas=4, rank=2, at=now)
    book.settle(snapshot(at=now))  # 8,000 free
    assert book.kv_tokens == {"w": 2_000}
    book.reserve("w", 1_000, 500, placed_at=now)  # within its share (2,000): the whole room still
    assert book.kv_tokens == {"w": 3_500}
    book.reserve("w", 5_000, 500, placed_at=now)  # past its share: nothing more until the others saw it
    assert book.kv_tokens == {"w": 10_000}
    book.apply_peers({"w": 2_000}, {}, replicas=4, rank=2, at=now + 0.05)
    assert not book.peers_moved
    book.apply_peers({"w": 2_000}, {}, replicas=4, rank=2, at=now + EXCHANGE_S)
    assert book.peers_moved  # seen by now: the pick settles again
    book.settle(snapshot(at=now + 0.05))
    assert book.kv_tokens == {"w": 2_000 + 7_000}  # still its turn: the 1,000 left


def test_a_settle_on_a_changed_snapshot_gives_the_view_a_settle_from_scratch_gives() -> None:
    index = FleetIndex(POOLS, stale_after_s=3.0)
    records = {f"w{i}": WorkerRecord(id=f"w{i}", pool="chat", model="llama", host="h", port=i, updated_at=100.0,
                                     kv_capacity_tokens=10_000, kv_usage=0.1 * i) for i in range(1, 4)}
    book = ReservationBook(settle_s=0.5)
    book.apply_peers({"w1": 1_000}, {}, replicas=2)
    book.settle(index.replace(records.values(), 100.0))  # 100.0 and 100.1: no turn open
    book.reserve("w3", 500, 500, placed_at=100.0)
    records["w2"] = replace(records["w2"], kv_usage=0.5)  # one worker's facts changed
    book.apply_peers({"w1": 2_000}, {}, replicas=2)  # and another replica placed more on w1
    changed = index.update({"w2": records["w2"]}, 100.1)
    book.settle(changed)
    fresh = ReservationBook(settle_s=0.5)
    fresh.apply_peers({"w1": 2_000}, {}, replicas=2)
    fresh.reserve("w3", 500, 500, placed_at=100.0)
    fresh.settle(changed)
    assert book.kv_tokens == fresh.kv_tokens == {
        "w1": 2_000 + int((10_000 * 0.9 - 2_000) / 2), "w2": int(10_000 * 0.5 / 2),
        "w3": 1_000 + int((10_000 * (1 - 0.1 * 3) - 1_000) / 2)}


@pytest.mark.parametrize(("usage", "bound"), [(0.0, 10_000 + 600), (0.84, 1_600)])
def test_four_replicas_picking_at_once_promise_at_most_the_free_room_and_one_request(
        usage: float, bound: int) -> None:
    """Every replica fills what its view allows, none seeing the others' placements yet: the shares add up
    to the free room, and only the replica holding the worker's turn may cross its share, by one request."""
    now = next_turn("w", 4, 0, 100.0)
    books = [ReservationBook(settle_s=0.5) for _ in range(4)]
    for rank, book in enumerate(books):
        book.apply_peers({}, {}, replicas=4, rank=rank, at=now)
        book.settle(snapshot(usage=usage, at=now))
    placed = 0
    for book in books:
        while room(book, int(10_000 * (1 - usage))) >= 600:
            book.reserve("w", 400, 200, placed_at=now)
            placed += 600
    assert 0 < placed <= bound
    if usage:  # 1,600 free, a request more than a share (400): the turn holder alone places one
        assert [book.own_kv_tokens.get("w", 0) for book in books] == [600, 0, 0, 0]


async def exchange(redis_client: aioredis.Redis, peer: PeerExchange, worker_ids: list[str] | None = None) -> None:
    """One flush and one refresh of ``peer`` against Redis, as the watcher runs them."""
    pipe = redis_client.pipeline(transaction=False)
    written = peer.queue_writes(pipe)
    await pipe.execute()
    if written is not None:
        written()
    pipe = redis_client.pipeline(transaction=False)
    apply = peer.queue_reads(pipe, worker_ids or [])
    apply(await pipe.execute())


async def test_once_one_replica_placed_the_large_prompt_and_the_exchange_ran_the_other_does_not_promise_it(
        redis_client: aioredis.Redis) -> None:
    keys = PeerKeys("peers-claim-test")
    now = [next_turn("w", 2, 0, 1_000.0)]  # a's turn on w (ranks: "a" 0, "b" 1)
    books = {name: ReservationBook(settle_s=5.0) for name in ("a", "b")}  # the snapshots never show it
    peers = {name: PeerExchange(keys, name, book, clock=lambda: now[0]) for name, book in books.items()}
    for name in ("a", "b", "a", "b"):  # both know there are two of them
        await exchange(redis_client, peers[name], ["w"])
        books[name].settle(snapshot(at=now[0]))
    assert room(books["a"]) == 10_000 and room(books["b"]) == 5_000

    books["a"].reserve("w", 6_000, 1_000, placed_at=now[0])  # 70 % of the free room, in a's turn
    assert room(books["a"]) == 0  # past its half until the others have seen it
    now[0] += 0.05
    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    books["b"].settle(snapshot(at=now[0]))
    assert books["b"].kv_tokens["w"] >= 7_000 and room(books["b"]) < 7_000  # b counts a's claim
    now[0] = next_turn("w", 2, 1, now[0])  # even in b's own turn: the whole room left is 3,000
    await exchange(redis_client, peers["b"], ["w"])
    books["b"].settle(snapshot(at=now[0]))
    assert room(books["b"]) == 3_000
    await exchange(redis_client, peers["a"], ["w"])
    books["a"].settle(snapshot(at=now[0]))  # a's claim is old enough to be seen: a's half of what is left
    assert room(books["a"]) == 1_500


async def test_one_replica_reads_what_another_published_and_a_dead_ones_fades(redis_client: aioredis.Redis) -> None:
    now = [1_000.0]
    keys = PeerKeys("peers-test")
    books = {name: ReservationBook(settle_s=0.5) for name in ("a", "b")}
    peers = {name: PeerExchange(keys, name, book, clock=lambda: now[0]) for name, book in books.items()}
    books["a"].reserve("w", 300, 100, placed_at=now[0])

    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    assert peers["b"].replicas == 2
    books["b"].settle(snapshot(at=now[0]))
    assert books["b"].prefill_tokens == {"w": 300}
    assert books["b"].kv_tokens["w"] == 400 + (10_000 - 400) // 2  # a's 400, and a's half of the rest
    now[0] += PRESENCE_TTL_S + 1  # a was killed: no more writes
    await exchange(redis_client, peers["b"], ["w"])
    books["b"].settle(snapshot(at=now[0]))
    assert peers["b"].replicas == 1 and books["b"].kv_tokens == {}
    assert await redis_client.hkeys(keys.reserved) == [b"w a"]  # a died holding it
    now[0] += PRESENCE_REFRESH_S
    await exchange(redis_client, peers["b"], ["w"])  # b's next beat removes what it read as dead
    assert await redis_client.hkeys(keys.reserved) == []


async def test_each_prefill_another_replica_placed_is_handed_to_the_ledger_once(redis_client: aioredis.Redis) -> None:
    """The exchange carries each replica's unsettled prefill per worker; what grew since the last read is what
    it placed, and reaches the reader's prefill ledger once, whether or not it is still unsettled."""
    now = [1_000.0]
    keys = PeerKeys("peers-prefill-test")
    books = {name: ReservationBook(settle_s=0.5) for name in ("a", "b")}
    peers = {name: PeerExchange(keys, name, book, clock=lambda: now[0]) for name, book in books.items()}
    first = books["a"].reserve("w", 3_000, 100, placed_at=now[0])
    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    assert books["b"].take_peer_placements() == [("w", (3_000, 1), now[0])]  # with when it was read
    await exchange(redis_client, peers["b"], ["w"])
    assert books["b"].take_peer_placements() == []  # read again: nothing new
    books["a"].release(first)  # gone from the exchange (settled or ended): nothing new either
    now[0] += 0.05
    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    assert books["b"].take_peer_placements() == []
    books["a"].reserve("w", 1_000, 100, placed_at=now[0], prefill_tokens=400)  # 600 of it cached there
    now[0] += 0.05
    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    assert books["b"].take_peer_placements() == [("w", (400, 1), now[0])]
    for _ in range(3):  # three placements between two exchanges: three requests
        books["a"].reserve("w", 200, 100, placed_at=now[0], prefill_tokens=50)
    now[0] += 0.05
    await exchange(redis_client, peers["a"], ["w"])
    await exchange(redis_client, peers["b"], ["w"])
    assert books["b"].take_peer_placements() == [("w", (150, 3), now[0])]


async def test_a_clean_stop_removes_the_replica_at_once(redis_client: aioredis.Redis) -> None:
    keys = PeerKeys("peers-test")
    book = ReservationBook(settle_s=0.5)
    book.reserve("w", 300, 100, placed_at=0.0)
    peer = PeerExchange(keys, "a", book)
    pipe = redis_client.pipeline(transaction=False)
    written = peer.queue_writes(pipe)
    await pipe.execute()
    assert written is not None
    written()
    pipe = redis_client.pipeline(transaction=False)
    peer.queue_leave(pipe)
    await pipe.execute()
    assert await redis_client.hgetall(keys.replicas) == {}
    assert await redis_client.hgetall(keys.reserved) == {}


async def test_a_prefix_placed_through_one_replica_leads_the_other_to_the_same_worker(
        redis_client: aioredis.Redis) -> None:
    keys = PeerKeys("peers-affinity-test")
    maps = {name: AffinityMap(max_entries=100) for name in ("a", "b")}
    peers = {name: PeerExchange(keys, name, ReservationBook(settle_s=0.5), affinity=maps[name])
             for name in ("a", "b")}

    facts = RequestFacts(path="/v1/chat/completions", method="POST", model="llama", session_id="s1",
                         prompt_parts=("system prompt " * 40, "question"))
    request_keys = prefix_keys(facts, 256, 4)
    maps["a"].record(request_keys, "w1")
    await exchange(redis_client, peers["a"])
    await exchange(redis_client, peers["b"])
    assert {k: maps["b"].entries.get(k) for k in request_keys} == dict.fromkeys(request_keys, "w1")
    maps["b"].record(request_keys[:1], "w2")  # the session moved on b; a follows, b does not re-apply a's
    await exchange(redis_client, peers["b"])
    await exchange(redis_client, peers["a"])
    await exchange(redis_client, peers["b"])
    assert maps["a"].entries[request_keys[0]] == "w2" and maps["b"].entries[request_keys[0]] == "w2"
    assert maps["a"].entries[request_keys[1]] == "w1"


async def test_the_prompt_blocks_one_replica_placed_reach_the_others_kv_index(redis_client: aioredis.Redis) -> None:
    """A new document's blocks, pending on the worker one replica sent it to, are pending there in the other
    replicas' view one exchange later: a second question about it, through another replica, follows it."""
    keys = PeerKeys("peers-blocks-test")
    outboxes = {name: PlacedPrefixes() for name in ("a", "b", "c")}
    heard: dict[str, list[tuple[str, list[int]]]] = {name: [] for name in outboxes}
    peers = {name: PeerExchange(keys, name, ReservationBook(settle_s=0.5), affinity=AffinityMap(max_entries=10),
                                placed_prefixes=outboxes[name],
                                on_placed=lambda w, k, name=name: heard[name].append((w, list(k))))
             for name in outboxes}
    outboxes["a"].placed("w1", [11, 12, 13])
    outboxes["a"].placed("w2", [])  # nothing new there: nothing sent
    assert peers["a"].has_writes()
    for name in ("a", "b", "c"):
        await exchange(redis_client, peers[name])
    assert heard == {"a": [], "b": [("w1", [11, 12, 13])], "c": [("w1", [11, 12, 13])]}
    assert not outboxes["a"].has_unsent
    await redis_client.xadd(keys.affinity, {"r": "x", "d": b"[]", "p": b'[["w3", ["not a key"]], 7, ["w4", [5]]]'})
    await exchange(redis_client, peers["b"])
    assert heard["b"][-1] == ("w4", [5])  # malformed entries are skipped, the well-formed one applied


def test_an_unchanged_affinity_key_is_not_published_again() -> None:
    affinity = AffinityMap(max_entries=10)
    affinity.record(["k1", "k2"], "w1")
    assert affinity.take_unpublished() == [("k1", "w1"), ("k2", "w1")]
    affinity.record(["k1", "k2"], "w1")
    affinity.record(["k2"], "w2")
    assert affinity.take_unpublished() == [("k2", "w2")]


def test_an_idle_replica_keeps_only_the_last_minute_of_the_others_placements() -> None:
    book = ReservationBook(settle_s=0.5)
    for second in range(0, 600, 10):  # ten minutes of exchanges and no pick here
        book.apply_peers({}, {}, replicas=2, rank=0, at=float(second), placed={"w": Unsettled(100, 1)})
    kept = book.take_peer_placements()
    assert [at for _, _, at in kept] == [float(s) for s in range(530, 600, 10)]
