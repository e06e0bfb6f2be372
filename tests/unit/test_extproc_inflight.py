"""In-flight accounting: own changes count at once, other replicas' share comes from Redis totals."""

from __future__ import annotations

from extproc.inflight import InflightTracker


def test_local_changes_are_immediate_and_pending_for_redis() -> None:
    tracker = InflightTracker()
    tracker.acquire("a")
    tracker.acquire("a")
    tracker.acquire("b")
    tracker.release("b")
    assert tracker.counts == {"a": 2, "b": 0}
    assert tracker.dirty.is_set()
    assert tracker.take_pending() == {"a": 2}  # b's acquire and release cancel: no write at all
    assert not tracker.dirty.is_set()


def test_other_replicas_share_is_redis_total_minus_what_we_flushed() -> None:
    tracker = InflightTracker()
    tracker.acquire("a")
    deltas = tracker.take_pending()
    tracker.mark_flushed(deltas)
    tracker.apply_remote({"a": 4, "b": 2})  # 4 = our 1 + 3 elsewhere
    assert tracker.counts == {"a": 4, "b": 2}
    tracker.acquire("a")  # not yet flushed: counted locally at once
    assert tracker.counts["a"] == 5
    tracker.apply_remote({"a": 4, "b": 2})  # the unflushed one stays counted once
    assert tracker.counts["a"] == 5
    tracker.release("a")
    tracker.release("a")
    tracker.mark_flushed(tracker.take_pending())
    tracker.apply_remote({"a": 3, "b": 0})
    assert tracker.counts == {"a": 3, "b": 0}


def test_failed_flush_is_retried() -> None:
    tracker = InflightTracker()
    tracker.acquire("a")
    deltas = tracker.take_pending()
    tracker.restore_pending(deltas)
    tracker.release("a")
    tracker.acquire("a")
    assert tracker.dirty.is_set() and tracker.take_pending() == {"a": 1}


def test_departed_workers_are_forgotten() -> None:
    tracker = InflightTracker()
    tracker.acquire("gone")
    tracker.release("gone")
    tracker.mark_flushed(tracker.take_pending())
    tracker.apply_remote({})
    assert tracker.counts == {}
