"""The prefill ledger: what a replica placed on a worker drains at the worker's prefill rate, and a pick reads
it with the other replicas' unseen placements."""

from __future__ import annotations

import pytest

from extproc.prefill_ledger import PrefillLedger
from poolgate.kernel.fleet import WorkerRecord


def worker(worker_id: str, rate: float = 1000.0) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="h", port=1, prefill_tokens_per_s=rate)


def test_placements_queue_up_and_drain_at_the_workers_rate() -> None:
    ledger = PrefillLedger(default_rate=8000.0)
    ledger.placed(worker("a"), 3000, now=10.0)
    ledger.placed(worker("a"), 1000, now=11.0)  # 2,000 left of the first, then this one
    assert ledger.left("a", 11.0) == pytest.approx(3000)
    assert ledger.left("a", 13.5) == pytest.approx(500)
    assert ledger.left("a", 20.0) == 0.0
    assert ledger.left("b", 11.0) == 0.0


def test_an_unknown_rate_drains_at_the_default() -> None:
    ledger = PrefillLedger(default_rate=8000.0)
    ledger.placed(worker("a", rate=0.0), 8000, now=0.0)
    assert ledger.left("a", 0.5) == pytest.approx(4000)


def test_the_backlog_drains_at_the_fastest_rate_the_workers_kind_has_shown() -> None:
    """A worker whose rate reads low because its recent prompts were cached still computes a cold one at the
    speed it showed before: the backlog must not outlive the prefill by the ratio of the two."""
    ledger = PrefillLedger(default_rate=8000.0)
    ledger.rates.observe((worker("twin", rate=27_000.0),))
    ledger.placed(worker("a", rate=900.0), 27_000, now=0.0)
    assert ledger.left("a", 0.5) == pytest.approx(13_500)
    assert ledger.left("a", 1.0) == 0.0


def test_a_pick_reads_this_replicas_backlog_and_the_others_unseen_placements() -> None:
    ledger = PrefillLedger(default_rate=8000.0)
    ledger.placed(worker("a"), 2000, now=0.0)
    reserved = {"a": 2000 + 700, "b": 300}  # every replica's prefill reservations, this one's included
    own = {"a": 2000}
    ahead = ledger.at(1.0, reserved, own)
    assert ahead.get("a", 0) == 1000 + 700
    assert ahead.get("b", 0) == 300
    assert ahead.get("c", 0) == 0


def test_a_placed_prompt_counts_in_full_on_a_worker_that_does_not_hold_it() -> None:
    """The placement marks its own blocks pending on the worker: its prefill and KV are read before that, or it
    would find itself cached there and leave the ledger empty (three 13k-token prompts then piled onto one
    worker in the lab)."""
    from types import SimpleNamespace

    from extproc.inflight import InflightTracker
    from extproc.metrics import Metrics
    from extproc.pipeline.place import Place
    from extproc.scheduling import Decision, build_scheduler
    from extproc.snapshot import build_snapshot
    from poolgate.kernel.config import SchedulingSettings
    from tests.unit.test_latency_model import NOW, POOLS, PROMPT, lookup_over, pick_request
    from tests.unit.test_latency_model import worker as publishing_worker

    workers = [publishing_worker("cold")]
    lookup = lookup_over(workers, {})
    fleet = SimpleNamespace(snapshot=build_snapshot(workers, POOLS, NOW, 3.0))
    settings = SchedulingSettings()
    place = Place(build_scheduler(settings), fleet, InflightTracker(), Metrics(), settings, clock=lambda: NOW,
                  prefix_cache=lookup)
    request = pick_request({"model": "llama", "prompt": PROMPT}, lookup)
    decision = place.pick(request, None)
    assert isinstance(decision, Decision)
    placement = place.commit(request, decision)
    assert placement.reservation.prefill_tokens == len(PROMPT)
    assert place.ledger.left("cold", NOW) == len(PROMPT)
    # The next request with the same prompt finds it pending there: little prefill of its own, behind this one.
    assert place.context().pending_prefill_tokens.get("cold", 0) == len(PROMPT)
