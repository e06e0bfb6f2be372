"""The virtual-time lab: the simulator's parse and tokens, deterministic replays, and each reference policy's
published rule on hand-made cases."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import orjson
import pytest

from bench import lab
from bench.lab_fleet import START_TIME, LabFleet, LabWorker, VirtualLoop, WorkerPlan
from bench.lab_routers import (
    BALANCE_ABS_THRESHOLD,
    CacheAware,
    DynamoKv,
    LabRequest,
    LeastRequest,
    Oracle,
    PowerOfTwo,
)
from bench.scenarios import SCENARIOS
from bench.sched_fleet import MODELS
from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.wire import EventBatch, Stored
from extproc.request import RequestFacts
from extproc.scheduling import PickRequest, RequestProfiler
from poolgate.kernel.config import SchedulingSettings
from simworker import protocol, tokens
from simworker.engine import EngineRequest

WORKERS = {"llama": ["a", "b", "c"]}


def request(index: int, token_ids: list[int]) -> LabRequest:
    words = [str(t) for t in token_ids]
    facts = RequestFacts("/v1/completions", "POST", "llama")
    return LabRequest(
        index=index, arrival_s=0.0, model="llama", workload="test", slo_ttft_s=1.0,
        profile=PickRequest(facts, len(token_ids), len(token_ids), 16, "short_chat"),
        blocks=PromptBlocks(len(token_ids), {16: prompt_keys(token_ids, 16)}),
        engine=EngineRequest(str(index), len(token_ids), 16, "stop", tokens.block_hashes(words, 16),
                             tuple(token_ids)))


DOC = list(range(1, 1601))  # 100 blocks


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_labs_tokeniser_is_the_simulated_workers(scenario: str) -> None:
    trace = SCENARIOS[scenario].trace(2.0, 60.0, 3, MODELS)
    tokeniser = lab.Tokeniser()
    for body in trace.bodies[:30]:
        data = orjson.loads(body)
        generation, ids = tokeniser.parse(data)
        expected = (protocol.parse_chat if "messages" in data else protocol.parse_completion)(data)
        assert generation == expected
        assert ids == tokens.token_ids(expected.prompt_tokens)


def test_a_cell_replays_exactly_by_seed() -> None:
    settings = SchedulingSettings()
    profiler = RequestProfiler(settings)
    cell = lab.CellSpec("h100", "sessions", bursty=False, level=1.0, requests=160, seed=3)
    routers = [(name, lab.router_factory(name, 3, settings)) for name in ("poolgate", "cache_aware")]
    first = lab.run_cell(cell, routers, rate=4.0, profiler=profiler)
    second = lab.run_cell(cell, routers, rate=4.0, profiler=profiler)
    strip = [{k: v for k, v in row.items() if k != "wall_s"} for row in first]
    assert strip == [{k: v for k, v in row.items() if k != "wall_s"} for row in second]
    assert all(row["requests"] > 100 and row["refused"] == 0 for row in first)
    assert 0 < first[0]["ttft_p50_s"] < first[0]["ttft_p99_s"] < 30


def test_the_figures_say_when_the_requests_that_set_the_p99_were_sent() -> None:
    """A tail sent in a trace's first second is its cold start (every cache empty): the row says so, where the
    p99 alone reads as any other."""
    made = [replace(request(i, DOC), arrival_s=i * 0.1) for i in range(200)]
    slow = {3, 4, 5}  # the 198th of 200 and the two after it: the p99 and the slower
    outcome = lab.Outcome(ttft_s={r.index: 2.0 if r.index in slow else 0.1 for r in made})
    row = lab.figures(made, SimpleNamespace(outcome=outcome, fleet=SimpleNamespace(workers={})))  # type: ignore[arg-type]
    assert row["ttft_p99_s"] == 2.0
    assert row["tail_sent_s"] == [0.3, 0.5]


def test_least_request_takes_the_fewest_in_flight() -> None:
    router = LeastRequest(WORKERS, 1)
    router.inflight.update({"a": 3, "b": 1, "c": 2})
    assert router.route(request(0, DOC), 0.0, 0.0) == "b"
    assert router.inflight["b"] == 2


def test_power_of_two_takes_the_less_loaded_of_two_drawn() -> None:
    router = PowerOfTwo({"llama": ["a", "b"]}, 1)
    chosen = set()
    for index in range(20):
        router.inflight.update({"a": 5, "b": 1})
        chosen.add(router.route(request(index, DOC), 0.0, 0.0))
    assert chosen == {"b"}


def test_cache_aware_follows_the_longest_match_over_the_threshold() -> None:
    router = CacheAware(WORKERS, 1)
    router.trees["b"].update(prompt_keys(DOC, 16))
    assert router.route(request(0, DOC + [7] * 50), 0.0, 0.0) == "b"  # 1600 of 1650 tokens match


def test_cache_aware_below_the_threshold_takes_the_smallest_tree() -> None:
    router = CacheAware(WORKERS, 1)
    router.trees["a"].update(prompt_keys(DOC[:320], 16))  # a holds a 20 % prefix of the request
    router.trees["b"].update(range(10))
    chosen = router.route(request(0, DOC), 0.0, 0.0)
    assert chosen == "c"  # the empty tree
    assert set(prompt_keys(DOC, 16)) <= router.trees["c"]  # what it sent is in that worker's tree now


def test_cache_aware_balances_when_load_is_imbalanced_past_both_thresholds() -> None:
    router = CacheAware(WORKERS, 1)
    router.trees["b"].update(prompt_keys(DOC, 16))
    router.inflight.update({"a": 10, "b": 10 + BALANCE_ABS_THRESHOLD + 1, "c": 12})
    assert router.route(request(0, DOC), 0.0, 0.0) == "a"
    router.trees["a"].clear()
    router.inflight.update({"a": 200, "b": 200 + BALANCE_ABS_THRESHOLD + 1, "c": 210})  # under 1.5 ×
    assert router.route(request(1, DOC), 0.0, 0.0) == "b"


def test_dynamo_kv_weighs_blocks_to_prefill_against_blocks_decoding() -> None:
    router = DynamoKv(WORKERS, 1, clock=lambda: 0.0)
    for worker_id in WORKERS["llama"]:
        router.on_kv_events(worker_id, EventBatch(0.0, ()))
    router.on_kv_events("b", EventBatch(0.0, (Stored(tuple(range(100)), None, tuple(DOC), 16),)))
    assert router.route(request(0, DOC), 0.0, 0.0) == "b"  # cost b: 0 + 100, a and c: 100 + 100
    # b now decodes 100 blocks; a second copy still goes there (0 + 200 < 100 + 100 is false: a tie at 200)
    router.active_blocks["b"] += 150
    assert router.route(request(1, DOC), 0.0, 0.0) in {"a", "c"}
    router.on_first_token(request(0, DOC), "b", 0.0)
    assert router.prefill_blocks["b"] == 0


def test_the_oracle_asks_the_engines_what_they_hold() -> None:
    loop = VirtualLoop()
    plans = [WorkerPlan(f"chat-l4-{i}", "chat", "llama", "l4-24gb", 8192) for i in range(2)]
    workers = {p.id: LabWorker(p, i) for i, p in enumerate(plans)}
    fleet = LabFleet(loop, workers, lambda w, o: None, lambda w, b: None)
    warm = request(0, DOC)
    fleet.submit("chat-l4-1", warm.engine)
    loop.run_until(lambda: not workers["chat-l4-1"].engine.has_work, START_TIME + 60)
    assert Oracle(fleet, 1).route(request(1, DOC + [5] * 20), loop.now, 0.0) == "chat-l4-1"


def _row(seed: int, router: str, p99: float, goodput: float = 1.0) -> dict[str, object]:
    return {"cell": "h100/mix/poisson/85%", "seed": seed, "router": router, "ttft_p99_s": p99, "goodput": goodput}


def test_over_seeds_judges_poolgate_against_the_best_peer_of_each_trace() -> None:
    rows = [_row(7, "poolgate", 1.0), _row(7, "cache_aware", 2.0), _row(7, "least_request", 4.0),
            _row(7, "oracle", 0.5),
            _row(8, "poolgate", 3.0, 0.9), _row(8, "cache_aware", 2.0), _row(8, "least_request", 1.5),
            _row(8, "oracle", 0.5),
            _row(9, "poolgate", 1.2, 0.8), _row(9, "cache_aware", 1.0), _row(9, "least_request", 3.0),
            _row(9, "oracle", 0.5)]
    summary = {row["router"]: row for row in lab.over_seeds(rows)}
    mine = summary["poolgate"]
    assert (mine["ttft_p99_s_median"], mine["ttft_p99_s_min"], mine["ttft_p99_s_max"]) == (1.2, 1.0, 3.0)
    assert mine["goodput_median"] == 0.9
    # 0.5x, 2x and 1.2x the best peer of the same trace (the oracle is none): the middle one, not 1.2 / 1.5
    assert mine["p99_over_best_peer_median"] == pytest.approx(1.2)
    assert summary["cache_aware"]["p99_over_best_peer_median"] is None
    assert summary["cache_aware"]["seeds"] == 3
