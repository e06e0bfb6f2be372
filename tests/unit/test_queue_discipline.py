"""The priority queue's discipline, pure with an injected clock: strict classes, weighted fair share by tokens,
deadline-aware short-prefill-first (FIFO on ties) per tenant, deadlines, overflow shedding, and domains that do
not block each other."""

from __future__ import annotations

import random

import pytest

from extproc.flow_queue import URGENT_SHARE, FlowQueue, QueueEntry, release_key
from tests.manual_clock import ManualClock


def drain(queue: FlowQueue, count: int | None = None) -> list[QueueEntry]:
    out = []
    while (entry := queue.next_candidate()) is not None and (count is None or len(out) < count):
        queue.take(entry)
        out.append(entry)
    return out


def test_strict_priority_regardless_of_arrival() -> None:
    queue = FlowQueue((5, 5, 5), 100, ManualClock())
    for index in range(6):
        queue.push("m", f"t{index % 2}", priority=2, tokens=10, payload=("low", index))
    for index in range(3):
        queue.push("m", "t9", priority=0, tokens=1000, payload=("high", index))
    queue.push("m", "t1", priority=1, tokens=10, payload=("mid", 0))
    order = [e.payload[0] for e in drain(queue)]
    assert order == ["high"] * 3 + ["mid"] + ["low"] * 6


def test_fifo_inside_a_tenant() -> None:
    queue = FlowQueue((5,), 100, ManualClock())
    for index in range(5):
        queue.push("m", "a", 0, tokens=random.Random(index).randint(1, 500), payload=index)
    assert [e.payload for e in drain(queue)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("weights", "sizes"), [((1.0, 1.0), (100, 1000)), ((3.0, 1.0), (50, 400)),
                                                ((1.0, 4.0), (300, 20))])
def test_weighted_fair_share_by_tokens_within_5_percent(weights: tuple[float, float], sizes: tuple[int, int]) -> None:
    """Two always-backlogged tenants with very different request sizes share released tokens by weight."""
    rng = random.Random(7)
    queue = FlowQueue((30,), 10_000, ManualClock())
    tenants = ("a", "b")
    for _ in range(2000):
        for tenant, weight, size in zip(tenants, weights, sizes, strict=True):
            queue.push("m", tenant, 0, tokens=max(1, int(rng.gauss(size, size / 4))), weight=weight)
    released = {"a": 0, "b": 0}
    for entry in drain(queue, 1500):
        released[entry.tenant] += entry.tokens
    share = released["a"] / (released["a"] + released["b"])
    expected = weights[0] / sum(weights)
    assert abs(share - expected) <= 0.05 * expected


def test_an_idle_tenant_earns_no_credit() -> None:
    queue = FlowQueue((30,), 10_000, ManualClock())
    for _ in range(100):
        queue.push("m", "busy", 0, tokens=100)
    drain(queue, 50)
    for _ in range(100):
        queue.push("m", "late", 0, tokens=100)
    next_ten = [e.tenant for e in drain(queue, 10)]
    assert 4 <= next_ten.count("late") <= 6  # shares from now on, no catch-up burst


def test_deadlines_follow_the_class() -> None:
    clock = ManualClock()
    queue = FlowQueue((10.0, 2.0), 100, clock)
    high = queue.push("m", "a", 0, 10).entry
    low = queue.push("m", "b", 1, 10).entry
    assert high is not None and low is not None
    assert (high.deadline, low.deadline) == (110.0, 102.0)
    clock.now = 101.9
    assert queue.expired() == []
    clock.now = 102.0
    assert queue.expired() == [low]
    assert queue.remove(low) and not queue.remove(low)
    clock.now = 200
    assert queue.expired() == [high]


def test_overflow_sheds_the_lowest_class_first() -> None:
    queue = FlowQueue((5, 5, 5), 3, ManualClock())
    kept = queue.push("m", "gold", 0, 10).entry
    mid = queue.push("m", "silver", 1, 10).entry
    old_low = queue.push("m", "bronze", 2, 10).entry
    assert queue.push("m", "bronze", 2, 10) .entry is None  # full and itself of the lowest class: refused
    pushed = queue.push("m", "gold", 0, 10)
    assert pushed.entry is not None and pushed.shed == (old_low,)
    pushed = queue.push("m", "gold", 0, 10)
    assert pushed.shed == (mid,)
    assert queue.push("m", "silver", 1, 10).entry is None
    assert len(queue) == 3 and kept in [e for e in drain(queue)]


def test_a_blocked_domain_does_not_hold_up_another() -> None:
    queue = FlowQueue((5, 5), 100, ManualClock())
    big = queue.push("model-a", "gold", 0, 5000).entry
    queue.push("model-a", "gold", 0, 10)
    other = queue.push("model-b", "bronze", 1, 10).entry
    assert queue.next_candidate() is big
    assert queue.next_candidate({"model-a"}) is other
    assert queue.has_waiting("model-a") and queue.has_waiting("model-b") and not queue.has_waiting("model-c")


def test_depth_by_class_and_tenant() -> None:
    queue = FlowQueue((5, 5), 100, ManualClock())
    queue.push("m", "a", 0, 1)
    queue.push("m", "a", 0, 1)
    entry = queue.push("m", "b", 1, 1).entry
    assert entry is not None
    assert queue.depth() == {(0, "a"): 2, (1, "b"): 1}
    queue.remove(entry)
    assert queue.depth() == {(0, "a"): 2} and len(queue) == 2


def test_a_short_prefill_overtakes_long_ones_of_its_tenant() -> None:
    clock = ManualClock()
    queue = FlowQueue((10.0,), 100, clock)
    for index in range(3):
        queue.push("m", "a", 0, tokens=6000, payload=f"long{index}", prefill_s=0.8)
        clock.now += 0.1
    queue.push("m", "a", 0, tokens=60, payload="short", prefill_s=0.01)
    queue.push("m", "a", 0, tokens=2000, payload="medium", prefill_s=0.2)
    assert [e.payload for e in drain(queue)] == ["short", "medium", "long0", "long1", "long2"]


def test_a_request_near_its_deadline_goes_before_shorter_ones() -> None:
    """Slack = deadline − now − prefill; at or below URGENT_SHARE × W it is urgent, least slack first."""
    clock = ManualClock()
    wait_s = 10.0
    queue = FlowQueue((wait_s,), 100, clock)
    old_long = queue.push("m", "a", 0, tokens=6000, payload="old_long", prefill_s=1.0).entry
    assert old_long is not None
    clock.now += 2.0
    queue.push("m", "a", 0, tokens=60, payload="short", prefill_s=0.01)
    assert queue.next_candidate().payload == "short"  # slack 10 − 2 − 1 = 7 > 5: not urgent yet
    clock.now = old_long.enqueued_at + wait_s * (1 - URGENT_SHARE) - old_long.prefill_s
    assert queue.next_candidate() is old_long  # slack = 5 = URGENT_SHARE × W: urgent now
    assert [e.payload for e in drain(queue)] == ["old_long", "short"]


def test_urgent_requests_go_least_slack_first() -> None:
    clock = ManualClock()
    queue = FlowQueue((4.0,), 100, clock)
    first = queue.push("m", "a", 0, tokens=10, payload="first", prefill_s=0.1).entry
    clock.now += 0.5
    second = queue.push("m", "a", 0, tokens=10_000, payload="second", prefill_s=1.5).entry
    assert first is not None and second is not None
    clock.now += 1.0  # slack: first 4 − 1.5 − 0.1 = 2.4, second 4 − 1.0 − 1.5 = 1.5; both ≤ 2
    assert release_key(second, clock.now, 2.0) < release_key(first, clock.now, 2.0)
    assert [e.payload for e in drain(queue)] == ["second", "first"]


def test_equal_prefills_keep_arrival_order() -> None:
    queue = FlowQueue((5.0,), 100, ManualClock())
    for index in range(5):
        queue.push("m", "a", 0, tokens=100, payload=index, prefill_s=0.3)
    assert [e.payload for e in drain(queue)] == [0, 1, 2, 3, 4]


def test_the_prefill_order_never_crosses_classes() -> None:
    queue = FlowQueue((5.0, 5.0), 100, ManualClock())
    queue.push("m", "a", 1, tokens=10, payload="short-low", prefill_s=0.001)
    queue.push("m", "b", 0, tokens=8000, payload="long-high", prefill_s=2.0)
    assert [e.payload for e in drain(queue)] == ["long-high", "short-low"]


def test_fair_shares_hold_when_one_tenant_sends_only_short_prefills() -> None:
    """Short prefills reorder a tenant's own requests; they buy it no larger share of the class."""
    rng = random.Random(3)
    queue = FlowQueue((30.0,), 10_000, ManualClock())
    for _ in range(1000):
        queue.push("m", "long", 0, tokens=500, prefill_s=rng.uniform(0.5, 1.0))
        queue.push("m", "short", 0, tokens=500, prefill_s=rng.uniform(0.0, 0.05))
    released = {"long": 0, "short": 0}
    for entry in drain(queue, 800):
        released[entry.tenant] += entry.tokens
    assert abs(released["short"] / sum(released.values()) - 0.5) <= 0.025


def test_a_blocked_domain_is_skipped_inside_the_order() -> None:
    queue = FlowQueue((5.0,), 100, ManualClock())
    queue.push("model-a", "a", 0, tokens=10, prefill_s=0.01)
    long_b = queue.push("model-b", "a", 0, tokens=9000, prefill_s=1.0).entry
    queue.push("model-b", "a", 0, tokens=9000, prefill_s=2.0)
    assert queue.next_candidate({"model-a"}) is long_b
