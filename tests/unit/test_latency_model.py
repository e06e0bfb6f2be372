"""The latency model (``scorers.latency``): predicted seconds to first token from the prefill ahead, this
request's own uncached prefill and what it would evict, and the KV filter that no longer refuses a worker
for the prompt it already holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.wire import EventBatch, Stored
from extproc.prefill_ledger import PrefillLedger
from extproc.request import RequestFacts
from extproc.scheduling import PickContext, PickRequest
from extproc.scheduling.filters import KvFits
from extproc.scheduling.scorers.latency import FLOOR_S, PredictedLatency
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from tests.unit.test_kv_cache_scoring import pick_request

NOW = 1_000.0
POOLS = (PoolSpec(name="chat", model="llama"),)
RATE = 10_000.0
PROMPT = list(range(1, 6401))
"""6,400 tokens = 400 blocks of 16."""


def worker(worker_id: str, **fields: object) -> WorkerRecord:
    values: dict[str, object] = {"prefill_tokens_per_s": RATE, "kv_capacity_tokens": 100_000, "kv_block_size": 16}
    values.update(fields)
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="h", port=1, updated_at=NOW, backend="sim",
                        kv_events_endpoint=f"tcp://{worker_id}:1", **values)  # type: ignore[arg-type]


def lookup_over(workers: list[WorkerRecord], held: dict[str, int], extra: dict[str, int] | None = None) -> CacheLookup:
    """Each worker's cache holds the first ``held[w]`` blocks of ``PROMPT`` and ``extra[w]`` blocks of others."""
    index = PrefixIndex()
    for w in workers:
        index.mark_known(w.id)
        blocks = held.get(w.id, 0)
        if blocks:
            index.apply(w.id, EventBatch(0.0, (Stored(tuple(range(blocks)), None, tuple(PROMPT[:blocks * 16]), 16),)))
        other = (extra or {}).get(w.id, 0)
        if other:
            tokens = tuple(range(10**6, 10**6 + other * 16))
            index.apply(w.id, EventBatch(0.0, (Stored(tuple(range(5000, 5000 + other)), None, tokens, 16),)))
    snapshot = build_snapshot(workers, POOLS, NOW, 3.0)
    return CacheLookup(index, lambda: snapshot, clock=lambda: NOW)


def predicted(workers: list[WorkerRecord], lookup: CacheLookup, request: PickRequest | None = None,
              **accounting: object) -> list[float]:
    request = request or pick_request({"model": "llama", "prompt": PROMPT}, lookup)
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), accounting.pop("inflight", {}),  # type: ignore[arg-type]
                          prefix_cache=lookup, **accounting)  # type: ignore[arg-type]
    return PredictedLatency(8000.0).seconds(request, workers, context)


@pytest.mark.parametrize(("queued", "warm_wins"), [(0, True), (5000, True), (5900, True), (6100, False)])
def test_a_warm_worker_wins_until_the_prefill_queued_there_costs_more_than_the_prefill_it_saves(
        queued: int, warm_wins: bool) -> None:
    workers = [worker("warm"), worker("cold")]
    lookup = lookup_over(workers, {"warm": 375})  # 6,000 of the 6,400 tokens
    warm, cold = predicted(workers, lookup, pending_prefill_tokens={"warm": queued})
    assert warm == pytest.approx((queued + 400) / RATE)
    assert cold == pytest.approx(6400 / RATE)
    assert (warm < cold) is warm_wins


def test_the_queue_is_the_ledger_in_tokens_not_the_waiting_count_times_this_request() -> None:
    """Three requests waiting at a warm worker cost what was placed there (the ledger), not 3 × 6,400."""
    workers = [worker("warm", waiting=3), worker("cold")]
    lookup = lookup_over(workers, {"warm": 375})
    warm, _ = predicted(workers, lookup, pending_prefill_tokens={"warm": 1200})
    assert warm == pytest.approx((1200 + 400) / RATE)
    # With no ledger entry (requests that came another way) the waiting count stands in, at this cost there.
    warm_alone, _ = predicted(workers, lookup)
    assert warm_alone == pytest.approx((3 * 400 + 400) / RATE)


def test_waiting_requests_cost_what_the_latest_placements_there_compute_not_this_prompt_each() -> None:
    """An engine serves its queue in order, so the requests it reports waiting are its latest arrivals: behind
    fifteen short questions about a document the worker holds, a new 6,400-token document waits for their
    15 × 50 tokens, not 15 × 6,400. Charged at this prompt's size, the questions sent every new document of a
    cold start to the workers already prefilling documents (the lab, H100s, shared documents with bursts:
    a p99 of 1.1 s against cache_aware's 0.8 s on one trace)."""
    workers = [worker("questions", waiting=15), worker("prefilling")]
    lookup = lookup_over(workers, {})
    ledger = PrefillLedger(RATE)
    for _ in range(15):
        ledger.placed(workers[0], 50, NOW - 1.0)  # drained by now as far as the ledger knows
    ledger.placed(workers[1], 4000, NOW)
    questions, prefilling = predicted(workers, lookup, pending_prefill_tokens=ledger.at(NOW), latest_prefill=ledger)
    assert questions == pytest.approx((15 * 50 + 6400) / RATE)
    assert prefilling == pytest.approx((4000 + 6400) / RATE)
    assert questions < prefilling
    # Where this replica has placed nothing yet, the waiting count stands in at this prompt's cost there.
    alone, _ = predicted(workers, lookup, latest_prefill=PrefillLedger(RATE))
    assert alone == pytest.approx((15 * 6400 + 6400) / RATE)


def test_workers_of_one_kind_share_the_fastest_rate_any_of_them_showed() -> None:
    """A worker busy with cached prompts reads a low rate; the same card is as fast as its fastest twin."""
    workers = [worker("busy", prefill_tokens_per_s=2_000.0), worker("idle", prefill_tokens_per_s=RATE),
               worker("bigger", prefill_tokens_per_s=40_000.0, kv_capacity_tokens=400_000)]
    lookup = lookup_over(workers, {})
    busy, idle, bigger = predicted(workers, lookup)
    assert busy == pytest.approx(idle) == pytest.approx(6400 / RATE)
    assert bigger == pytest.approx(6400 / 40_000.0)


def test_a_kind_keeps_the_fastest_rate_it_has_shown_when_its_engines_later_read_slower() -> None:
    """Mostly cached prompts make every engine of a kind read a low rate at once; a cold prompt still meets the
    card's speed, and the prediction keeps it."""
    scorer = PredictedLatency(8000.0)
    request = pick_request({"model": "llama", "prompt": PROMPT}, lookup_over([worker("a")], {}))

    def seconds(rate: float) -> float:
        workers = [worker("a", prefill_tokens_per_s=rate), worker("b", prefill_tokens_per_s=rate)]
        context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}, prefix_cache=lookup_over(workers, {}))
        return scorer.seconds(request, workers, context)[0]

    assert seconds(RATE) == pytest.approx(6400 / RATE)
    assert seconds(900.0) == pytest.approx(6400 / RATE)
    assert seconds(2 * RATE) == pytest.approx(6400 / (2 * RATE))


def test_a_warm_slow_card_loses_to_a_cold_fast_one_once_its_step_costs_more_than_the_fast_cards_prefill() -> None:
    """A session's next turn: the L4 that holds 6,000 of its 6,400 tokens computes 400 of them, the idle H100
    all 6,400 at 10× the rate; by throughput alone they are even, but every first token waits for an engine step
    and the L4's is 70 ms to the H100's 8 (the shortest gap each kind has shown, under load or not)."""
    l4 = {"prefill_tokens_per_s": 4_000.0, "kv_capacity_tokens": 35_000}
    h100 = {"prefill_tokens_per_s": 64_000.0, "kv_capacity_tokens": 450_000}
    workers = [worker("l4-warm", inter_token_s=0.070, **l4), worker("l4-busy", inter_token_s=0.180, **l4),
               worker("h100", inter_token_s=0.008, **h100)]
    lookup = lookup_over(workers, {"l4-warm": 375})
    warm, _, cold = predicted(workers, lookup)
    assert warm == pytest.approx(400 / 4_000.0 + 0.070 - 0.008)  # the L4 kind's shortest step, not the busy one's
    assert cold == pytest.approx(6400 / 64_000.0)
    assert cold < warm
    # Without step times known the two read even (the throughput alone): a tie, which the picker draws.
    unknown = [replace(w, inter_token_s=-1.0) for w in workers]
    warm_blind, _, cold_blind = predicted(unknown, lookup_over(unknown, {"l4-warm": 375}))
    assert warm_blind == pytest.approx(cold_blind)


def test_workers_of_one_kind_pay_no_step_term() -> None:
    """Among twins the step is the same for all and cancels: the prediction is the queue and the prefill."""
    workers = [worker("warm", inter_token_s=0.070), worker("cold", inter_token_s=0.090)]
    warm, cold = predicted(workers, lookup_over(workers, {"warm": 375}))
    assert warm == pytest.approx(400 / RATE)
    assert cold == pytest.approx(6400 / RATE)


def test_a_new_prefix_goes_where_it_evicts_least() -> None:
    """Two cold workers, one with its cache full of other prefixes: the prompt would push them out there."""
    workers = [worker("full", kv_capacity_tokens=8_000), worker("empty", kv_capacity_tokens=8_000)]
    lookup = lookup_over(workers, {}, extra={"full": 400})  # 6,400 tokens of other prefixes kept for reuse
    request = replace(pick_request({"model": "llama", "prompt": PROMPT}, lookup), output_tokens=100)
    full, empty = predicted(workers, lookup, request)
    evicted = 6400 + 100 - (8000 - 6400)
    assert full == pytest.approx((6400 + evicted) / RATE)
    assert empty == pytest.approx(6400 / RATE)


def test_streams_already_running_break_a_tie() -> None:
    workers = [worker("a"), worker("b")]
    lookup = lookup_over(workers, {})
    a, b = predicted(workers, lookup, inflight={"a": 10, "b": 2})
    assert b < a
    scores = PredictedLatency(8000.0).score(
        pick_request({"model": "llama", "prompt": PROMPT}, lookup), workers,
        PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {"a": 10, "b": 2}, prefix_cache=lookup))
    assert scores[1] == 1.0 and scores[0] == pytest.approx((b + FLOOR_S) / (a + FLOOR_S))


def test_an_unknown_stream_is_estimated_from_affinity_not_taken_as_empty() -> None:
    workers = [worker("known"), worker("unknown")]
    lookup = lookup_over([workers[0]], {})
    request = replace(pick_request({"model": "llama", "prompt": PROMPT}, lookup), affinity_keys=("p",))
    known, unknown = predicted(workers, lookup, request, affinity={"p": "unknown"})
    assert unknown == pytest.approx(0.0) and known == pytest.approx(6400 / RATE)


def test_the_kv_filter_keeps_a_busy_worker_for_the_prompt_its_cache_holds() -> None:
    """90 % in use, much of it the shared prompt: only the uncached part and the output need room."""
    workers = [worker("warm", kv_capacity_tokens=20_000, kv_usage=0.7), worker("cold", kv_capacity_tokens=20_000,
                                                                              kv_usage=0.7)]
    lookup = lookup_over(workers, {"warm": 375})
    request = replace(pick_request({"model": "llama", "prompt": PROMPT}, lookup), prompt_tokens=6400,
                      output_tokens=500)
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}, prefix_cache=lookup)
    kept = KvFits(0.02).filter(request, workers, context)
    assert [w.id for w in kept] == ["warm"]  # free 5,600: 400 + 500 fit, 6,400 + 500 do not
    without_index = KvFits(0.02).filter(replace(request, prompt_blocks=None), workers, context)
    assert without_index == []


def test_a_request_without_its_prompt_tokenised_is_predicted_from_its_estimate() -> None:
    workers = [worker("a", waiting=1), worker("b")]
    lookup = lookup_over(workers, {})
    request = PickRequest(RequestFacts("/v1/chat/completions", "POST", "llama"), 800, 800, 10, "short_chat")
    a, b = predicted(workers, lookup, request)
    assert a == pytest.approx(1600 / RATE) and b == pytest.approx(800 / RATE)
