"""The backlog of quota charges kept while Redis is away: summed per tenant and second, resent unchanged until
written, bounded by the minutes the counters live."""

from __future__ import annotations

from extproc.quota_backlog import KEEP_MINUTES, Charge, UnwrittenCharges
from tests.manual_clock import ManualClock

T0 = 1_000_020.0  # the start of a calendar minute (16,667 × 60)


def test_charges_of_one_second_are_summed_and_corrections_net_out() -> None:
    backlog = UnwrittenCharges(ManualClock(T0))
    for _ in range(3):
        backlog.add("acme", 1_000_020, requests=1, tokens=100, admission=True)
    backlog.add("acme", 1_000_020, tokens=-40)  # one request used 60 of its 100
    backlog.add("acme", 1_000_021, requests=1, tokens=10, admission=True)
    backlog.add("beta", 1_000_020, requests=1, admission=True)
    batches = {b.tenant: b for b in backlog.batches()}
    assert batches["acme"].charges == (Charge(1_000_020, 3, 260), Charge(1_000_021, 1, 10))
    assert (batches["acme"].requests, batches["beta"].requests) == (4, 1)
    assert batches["beta"].charges == (Charge(1_000_020, 1, 0),)


def test_a_batch_not_written_is_resent_with_its_id_and_content_and_later_charges_wait_for_it() -> None:
    backlog = UnwrittenCharges(ManualClock(T0))
    backlog.add("acme", 1_000_020, requests=1, admission=True)
    [first] = backlog.batches()
    backlog.add("acme", 1_000_020, requests=1, admission=True)  # while the first is being sent
    assert backlog.batches() == [first], "the unwritten batch is sent again, alone, unchanged"
    backlog.written(first)
    [second] = backlog.batches()
    assert second.id != first.id and second.charges == (Charge(1_000_020, 1, 0),)
    backlog.written(second)
    assert not backlog and backlog.batches() == []


def test_charges_older_than_the_kept_minutes_are_dropped_and_counted() -> None:
    clock = ManualClock(T0)
    backlog = UnwrittenCharges(clock)
    backlog.add("acme", int(T0), requests=1, admission=True)
    [sealed] = backlog.batches()
    backlog.add("acme", int(T0) + 1, requests=1, admission=True)
    backlog.add("acme", int(T0) + 1, requests=1, admission=True)
    clock.now = T0 + 60 * (KEEP_MINUTES - 1)  # the charges' minute is still the oldest one kept
    assert backlog.batches() == [sealed]
    clock.now = T0 + 60 * KEEP_MINUTES
    assert backlog.batches() == [] and not backlog
    assert backlog.expired == 3
