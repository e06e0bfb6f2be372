"""The prefill ledger: what a replica placed on a worker drains at the worker's prefill rate, and the other
replicas' placements join it as the exchange brings them, drained the same way."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from extproc.inflight import InflightTracker
from extproc.kvcache.lookup import CacheLookup
from extproc.metrics import Metrics
from extproc.pipeline.place import Place
from extproc.prefill_ledger import LATEST_PLACEMENTS, PrefillLedger, Unsettled, placed_since
from extproc.scheduling import Decision, PickRequest, build_scheduler
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from tests.unit.test_latency_model import NOW, POOLS, PROMPT, lookup_over, pick_request
from tests.unit.test_latency_model import worker as publishing_worker


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


def test_the_latest_placements_are_remembered_in_tokens_and_extrapolated_past_the_memory() -> None:
    """What the engine reports waiting is its latest arrivals: the ledger answers what they computed, in
    tokens, from this replica's own placements there (a document, then three short questions)."""
    ledger = PrefillLedger(default_rate=8000.0)
    assert ledger.latest_tokens("a", 3) is None
    for tokens in (6000, 50, 40, 30):
        ledger.placed(worker("a"), tokens, now=0.0)
    assert ledger.left("a", 0.0) == pytest.approx(6120)
    assert ledger.latest_tokens("a", 2) == 70
    assert ledger.latest_tokens("a", 4) == 6120
    assert ledger.latest_tokens("a", 8) == 12_240  # more than were placed: at their mean
    assert ledger.latest_tokens("b", 1) is None
    for _ in range(LATEST_PLACEMENTS):
        ledger.placed(worker("a"), 10, now=0.0)
    assert ledger.latest_tokens("a", LATEST_PLACEMENTS) == 10 * LATEST_PLACEMENTS
    assert ledger.latest_tokens("a", 2 * LATEST_PLACEMENTS) == 20 * LATEST_PLACEMENTS  # the document forgotten


def test_several_placements_read_at_once_are_remembered_as_that_many_requests() -> None:
    """An exchange through Redis brings another replica's placements a batch at a time: three questions of 50
    tokens read together are three waiting requests of 50, not one of 150 (which would make each waiting
    request there look three times as long)."""
    ledger = PrefillLedger(default_rate=8000.0)
    ledger.placed(worker("a"), 6000, now=0.0)
    ledger.placed(worker("a"), 150, now=0.0, requests=3)
    assert ledger.latest_tokens("a", 1) == 50
    assert ledger.latest_tokens("a", 3) == 150
    assert ledger.left("a", 0.0) == pytest.approx(6150)
    ledger.placed(worker("a"), 10 * (LATEST_PLACEMENTS + 6), now=0.0, requests=LATEST_PLACEMENTS + 6)
    assert ledger.latest_tokens("a", LATEST_PLACEMENTS) == 10 * LATEST_PLACEMENTS  # only the latest remembered


def test_each_replicas_growth_is_what_it_placed_and_a_drop_elsewhere_does_not_hide_it() -> None:
    before = {("a", "r1"): Unsettled(1_000, 1), ("a", "r2"): Unsettled(500, 1), ("b", "r1"): Unsettled(300, 1)}
    current = {("a", "r1"): Unsettled(1_400, 3), ("b", "r1"): Unsettled(300, 1),  # r2's 500 on a settled
               ("c", "r2"): Unsettled(200, 1), ("d", "r1"): Unsettled(0, 1)}  # a request all cached there
    assert placed_since(before, current) == {"a": (400, 2), "c": (200, 1), "d": (0, 1)}
    assert placed_since(current, current) == {}
    # net of a settled one: more tokens, as many requests (or a replica that does not say): at least one
    assert placed_since({("a", "r1"): Unsettled(100, 1)}, {("a", "r1"): Unsettled(300, 1)}) == {"a": (200, 1)}


def test_another_replicas_placement_stays_in_the_queue_estimate_until_drained() -> None:
    """A prompt another replica placed counts ahead on its worker from the read that brought it until the
    worker's rate has computed it, as this replica's own do: not only while the agent's record does not show
    it yet (then the next prompt here was sent behind a queue this replica no longer saw)."""
    now = [100.0]
    record = WorkerRecord(id="w", pool="chat", model="llama", host="h", port=1, updated_at=100.0, metrics_at=100.0,
                          prefill_tokens_per_s=1000.0)
    fleet = SimpleNamespace(snapshot=build_snapshot([record], POOLS, 100.0, 3.0))
    settings = SchedulingSettings()
    place = Place(build_scheduler(settings), fleet, InflightTracker(), Metrics(), settings, clock=lambda: now[0])
    place.reservations.apply_peers({"w": 2_500}, {"w": 2_000}, replicas=2, at=100.0, placed={"w": Unsettled(2_000, 1)})
    assert place.context().pending_prefill_tokens.get("w", 0) == 2_000
    now[0] = 100.5  # the agent has seen it: the other replica's reservation is gone
    fleet.snapshot = build_snapshot([replace(record, metrics_at=100.5)], POOLS, 100.5, 3.0)
    place.reservations.apply_peers({}, {}, replicas=2, at=100.5)
    assert place.context().pending_prefill_tokens.get("w", 0) == 1_500
    now[0] = 102.0
    assert place.context().pending_prefill_tokens.get("w", 0) == 0


def placing_on_one_cold_worker(worker_id: str) -> tuple[Place, CacheLookup, PickRequest]:
    """A replica's place stage over one worker that publishes KV events and holds nothing yet, its KV index, and
    a request for ``PROMPT`` (6,400 tokens, 400 blocks)."""
    workers = [publishing_worker(worker_id)]
    lookup = lookup_over(workers, {})
    fleet = SimpleNamespace(snapshot=build_snapshot(workers, POOLS, NOW, 3.0))
    settings = SchedulingSettings()
    place = Place(build_scheduler(settings), fleet, InflightTracker(), Metrics(), settings, clock=lambda: NOW,
                  prefix_cache=lookup)
    return place, lookup, pick_request({"model": "llama", "prompt": PROMPT}, lookup)


def test_a_placed_prompt_counts_in_full_on_a_worker_that_does_not_hold_it() -> None:
    """The placement marks its own blocks pending on the worker: its prefill and KV are read before that, or it
    would find itself cached there and leave the ledger empty (three 13k-token prompts then piled onto one
    worker in the lab)."""
    place, _, request = placing_on_one_cold_worker("cold")
    decision = place.pick(request, None)
    assert isinstance(decision, Decision)
    placement = place.commit(request, decision)
    assert placement.reservation.prefill_tokens == len(PROMPT)
    assert place.ledger.left("cold", NOW) == len(PROMPT)
    # The next request with the same prompt finds it pending there: little prefill of its own, behind this one.
    assert place.context().pending_prefill_tokens.get("cold", 0) == len(PROMPT)


def test_a_placement_on_a_warm_worker_reserves_the_new_kv_and_queues_the_prefill_from_one_walk() -> None:
    """A second request with a prompt still pending on its worker shares no KV with it (the engine admits them
    apart) but computes none of it again; the commit reads both from the walk that marks its blocks pending."""
    place, lookup, request = placing_on_one_cold_worker("w")
    first = place.pick(request, None)
    assert isinstance(first, Decision)
    place.commit(request, first)
    second = place.pick(request, None)
    assert isinstance(second, Decision)
    walks = []
    walk = lookup.index.cached_prefixes
    lookup.index.cached_prefixes = lambda *args: walks.append(args) or walk(*args)  # type: ignore[method-assign]
    placement = place.commit(request, second)
    assert len(walks) == 1
    whole = min(len(PROMPT) // 16 * 16, len(PROMPT) - 1)  # pending there since the first (its last token: its own)
    assert (placement.reservation.kv_tokens, placement.reservation.prefill_tokens) == (
        len(PROMPT) + request.output_tokens, len(PROMPT) - whole)
    assert place.ledger.left("w", NOW) == len(PROMPT) + len(PROMPT) - whole


def test_what_another_replica_placed_drains_from_when_it_was_read() -> None:
    """A replica that picks nothing for a while enters the others' placements at its next pick: they were
    queued behind its own backlog when read, and the engine has worked on both since."""
    ledger = PrefillLedger(default_rate=1000.0)
    ledger.placed(worker("a"), 3000, now=10.0)
    ledger.placed(worker("a"), 2000, now=13.0, since=11.0)  # read at 11 s, when 2,000 of the first were left
    assert ledger.left("a", 13.0) == 2000  # 2,000 + 2,000 at 11 s, 2 s of work done since
    ledger.placed(worker("b"), 2000, now=20.0, since=15.0)  # long done by now
    assert ledger.left("b", 20.0) == 0
