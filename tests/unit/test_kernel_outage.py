"""A Redis outage shows once in the log (and in a gauge), and a Redis that returns empty does not empty the
fleet until the grace period has passed."""

from __future__ import annotations

import logging

import pytest

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.outage import OutageLog, ReturnGrace
from poolgate.kernel.store import FleetChange

LOG = logging.getLogger("test.outage")


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    gauge: list[bool] = []
    redis = OutageLog(LOG, "redis away (%s)", "redis back", on_change=gauge.append)
    with caplog.at_level(logging.INFO, logger="test.outage"):
        assert redis.up() is False  # the first report is no return from an outage
        for _ in range(3):
            redis.down(ConnectionError("refused"))
        returned = [redis.up(), redis.up()]
    assert [r.getMessage() for r in caplog.records] == ["redis away (refused)", "redis back"]
    assert returned == [True, False]
    assert gauge == [True, False, True]


def record(worker_id: str, updated_at: float) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="m", host="127.0.0.1", port=9000, updated_at=updated_at)


def test_workers_missing_after_redis_returns_are_kept_only_within_the_grace_period() -> None:
    grace = ReturnGrace(grace_s=2.0)
    assert [w.id for w in grace.fill_in([record("a", 100.0), record("b", 100.0)], now=100.0)] == ["a", "b"]
    grace.redis_returned(now=105.0)
    kept = grace.fill_in([record("a", 105.0)], now=105.0)
    # b is carried over, as fresh as when it was last read (its age since then says nothing).
    assert [(w.id, w.updated_at) for w in kept] == [("a", 105.0), ("b", 105.0)]
    assert [w.id for w in grace.fill_in([record("a", 107.5)], now=107.5)] == ["a"]


def test_without_an_outage_a_worker_that_left_is_gone_at_once() -> None:
    grace = ReturnGrace(grace_s=2.0)
    grace.fill_in([record("a", 1.0), record("b", 1.0)], now=1.0)
    assert [w.id for w in grace.fill_in([record("a", 1.5)], now=1.5)] == ["a"]


@pytest.mark.parametrize(("message", "change"), [
    (b"register w1", FleetChange("register", "w1")),
    ("update pod-7.x", FleetChange("update", "pod-7.x")),
    (b"deregister w2", FleetChange("deregister", "w2")),
])
def test_a_change_message_names_its_worker(message: bytes | str, change: FleetChange) -> None:
    assert FleetChange.parse(message) == change
