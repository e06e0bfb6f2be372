"""extproc-local state the pick reads: optimistic KV reservations and the bounded affinity map."""

from __future__ import annotations

from extproc.affinity import AffinityMap
from extproc.reservations import ReservationBook
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord

POOLS = (PoolSpec(name="chat", model="llama"),)


def snapshot_at(updated_at: float, *ids: str) -> object:
    records = [WorkerRecord(id=i, pool="chat", model="llama", host="h", port=1, updated_at=updated_at) for i in ids]
    return build_snapshot(records, POOLS, taken_at=updated_at, stale_after_s=3.0)


def test_reservation_counts_the_whole_footprint_until_the_record_shows_it() -> None:
    book = ReservationBook(settle_s=0.5)
    first = book.reserve("w", prompt_tokens=1000, output_tokens=200, placed_at=10.0)
    book.reserve("w", prompt_tokens=500, output_tokens=100, placed_at=10.3)
    assert book.kv_tokens == {"w": 1800} and book.prefill_tokens == {"w": 1500}
    book.settle(snapshot_at(10.4, "w"))  # a record written before the placements settled: nothing changes
    assert book.kv_tokens == {"w": 1800}
    book.settle(snapshot_at(10.6, "w"))  # newer than the first placement + 0.5 s: only its decode room stays
    assert book.kv_tokens == {"w": 200 + 600} and book.prefill_tokens == {"w": 500}
    book.settle(snapshot_at(11.0, "w"))  # two streams with 200 and 100 to write: both grow 100, then one ends
    assert book.kv_tokens == {"w": 200} and book.prefill_tokens == {}
    book.release(first)
    book.release(first)  # twice is harmless
    assert book.kv_tokens == {"w": 100}


def streaming_at(taken_at: float, inter_token_s: float, ttft_s: float = -1.0) -> object:
    """A worker whose agent measured the gap between a stream's tokens (and time to first token), read now."""
    record = WorkerRecord(id="w", pool="chat", model="llama", host="h", port=1, updated_at=taken_at,
                          metrics_at=taken_at, inter_token_s=inter_token_s, ttft_ewma_s=ttft_s)
    return build_snapshot([record], POOLS, taken_at=taken_at, stale_after_s=3.0)


def test_decode_room_shrinks_by_what_the_stream_has_written() -> None:
    book = ReservationBook(settle_s=0.5)
    stream = book.reserve("w", prompt_tokens=1000, output_tokens=400, placed_at=10.0)
    book.settle(streaming_at(10.6, inter_token_s=0.05, ttft_s=1.0))  # shown by the record: its decode room stays
    assert book.kv_tokens == {"w": 400}
    book.settle(streaming_at(11.0, inter_token_s=0.05, ttft_s=1.0))  # its first token is due now: nothing written
    assert book.kv_tokens == {"w": 400}
    book.settle(streaming_at(16.0, inter_token_s=0.05, ttft_s=1.0))  # 5 s at 20 tokens a second: 100 written
    assert book.kv_tokens == {"w": 300}
    book.settle(streaming_at(40.0, inter_token_s=0.05, ttft_s=1.0))  # longer than expected: no room left to keep
    assert book.kv_tokens == {}
    book.release(stream)
    assert book.kv_tokens == {}


def test_decode_room_counts_only_what_the_stream_wrote_before_the_usage_was_read() -> None:
    """The record's usage holds the tokens written until its metrics were read; those written since are not in
    it yet, so their room stays reserved however late the record is settled."""
    book = ReservationBook(settle_s=0.5)
    book.reserve("w", prompt_tokens=1000, output_tokens=400, placed_at=10.0)
    record = WorkerRecord(id="w", pool="chat", model="llama", host="h", port=1, updated_at=16.0, metrics_at=16.0,
                          inter_token_s=0.05, ttft_ewma_s=1.0)
    book.settle(build_snapshot([record], POOLS, taken_at=16.0, stale_after_s=3.0))
    assert book.kv_tokens == {"w": 300}  # read 5 s after its first token: 100 written
    later = record.with_live(updated_at=18.0)  # a heartbeat 2 s on, with the same reading of the metrics
    book.settle(build_snapshot([later], POOLS, taken_at=18.0, stale_after_s=3.0))
    assert book.kv_tokens == {"w": 300}  # not 260: the usage does not show the 40 tokens written since


def test_decode_room_stays_whole_while_the_workers_token_gap_is_unknown() -> None:
    book = ReservationBook(settle_s=0.5)
    stream = book.reserve("w", prompt_tokens=1000, output_tokens=400, placed_at=10.0)
    book.settle(streaming_at(30.0, inter_token_s=-1.0))
    assert book.kv_tokens == {"w": 400}  # an engine that does not export the histogram: as before, all of it
    book.settle(streaming_at(31.0, inter_token_s=0.1))  # known now: 20.5 s of writing from placement + settle
    assert book.kv_tokens == {"w": 400 - 205}
    book.release(stream)
    assert book.kv_tokens == {}


def test_the_streams_room_is_the_peak_of_their_growth_not_the_sum() -> None:
    """Streams share every engine step: by the time the longest has written its output, the shorter ones ended
    and freed their blocks. Room is kept for the highest the worker's usage will climb."""
    book = ReservationBook(settle_s=0.5)
    for prompt, output in ((2000, 100), (2000, 300), (2000, 600)):
        book.reserve("w", prompt_tokens=prompt, output_tokens=output, placed_at=10.0)
    book.settle(streaming_at(10.6, inter_token_s=-1.0))
    # 3 × 100 while all three write; then 2 × 300 less the first's 2,100 freed; then 600 less 4,400 freed
    assert book.kv_tokens == {"w": 300}


def test_a_short_streams_end_makes_room_for_a_long_one_and_its_release_reprices() -> None:
    book = ReservationBook(settle_s=0.5)
    short = book.reserve("w", prompt_tokens=10, output_tokens=50, placed_at=10.0)
    book.reserve("w", prompt_tokens=10, output_tokens=1000, placed_at=10.0)
    book.settle(streaming_at(10.6, inter_token_s=-1.0))
    assert book.kv_tokens == {"w": 1000 - 10}  # both grow 50, the short one frees 60, the long one grows 950
    book.release(short)  # priced again without it: the long one's whole room
    assert book.kv_tokens == {"w": 1000}


def test_stream_end_releases_everything_even_before_settling() -> None:
    book = ReservationBook(settle_s=0.5)
    reservation = book.reserve("w", 100, 100, placed_at=1.0)
    book.settle(snapshot_at(5.0))  # the worker left the snapshot: kept until the stream ends
    assert book.kv_tokens == {"w": 200}
    book.release(reservation)
    assert book.kv_tokens == {} and book.prefill_tokens == {}


def test_affinity_map_is_bounded_and_least_recently_used_goes_first() -> None:
    affinity = AffinityMap(max_entries=3)
    affinity.record(("a", "b"), "w1")
    affinity.record(("c",), "w2")
    affinity.record(("a",), "w3")  # refreshed: now the newest, and moved to w3
    affinity.record(("d",), "w2")
    assert dict(affinity.entries) == {"c": "w2", "a": "w3", "d": "w2"}
    assert len(affinity) == 3


def test_affinity_map_of_size_zero_keeps_nothing() -> None:
    affinity = AffinityMap(max_entries=0)
    affinity.record(("a",), "w")
    assert len(affinity) == 0


def test_reservations_settle_on_the_agents_reading_not_on_heartbeats() -> None:
    book = ReservationBook(settle_s=0.5)
    book.reserve("w", 100, 50, placed_at=10.0)
    record = WorkerRecord(id="w", pool="chat", model="llama", host="h", port=1, updated_at=20.0, metrics_at=10.2)
    book.settle(build_snapshot([record], POOLS, taken_at=20.0, stale_after_s=30.0))
    assert book.kv_tokens == {"w": 150}  # heartbeats went on, but the metrics were read before it settled
    book.settle(build_snapshot([record.with_live(metrics_at=10.6)], POOLS, taken_at=20.0, stale_after_s=30.0))
    assert book.kv_tokens == {"w": 50}


def test_old_agent_facts_count_as_unknown() -> None:
    live = {"kv_capacity_tokens": 1000, "kv_usage": 0.9, "waiting": 7, "gpu_memory_free_mib": 10.0}
    fresh = WorkerRecord(id="f", pool="chat", model="llama", host="h", port=1, updated_at=100.0, metrics_at=99.0,
                         **live)  # type: ignore[arg-type]
    old = fresh.with_live(id="o", metrics_at=90.0)
    never = fresh.with_live(id="n", metrics_at=0.0)  # no agent: the fields are whatever was registered
    snapshot = build_snapshot([fresh, old, never], POOLS, taken_at=100.0, stale_after_s=3.0)
    by_id = snapshot.by_id
    assert (by_id["f"].kv_capacity_tokens, by_id["f"].waiting) == (1000, 7)
    assert (by_id["o"].kv_capacity_tokens, by_id["o"].kv_usage, by_id["o"].waiting) == (0, 0.0, 0)
    assert by_id["o"].gpu_memory_free_mib == -1.0 and by_id["o"].kv_block_size == fresh.kv_block_size
    assert by_id["n"].kv_capacity_tokens == 1000
