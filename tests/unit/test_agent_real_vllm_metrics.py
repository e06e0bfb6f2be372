"""The agent against a real vLLM's ``/metrics`` (``tests/fixtures/vllm-0.32-cpu/metrics.txt``): the facts it has
always read, and those a real engine showed it must read too: the sleep state (a sleeping engine answers
``/health`` and looks idle, so it got traffic), the prefix-cache counters and the waiting reasons."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agent.live import live_fields, notable_change
from agent.rates import RateState, advance
from agent.vllm_metrics import parse_engine_metrics
from extproc.request import RequestFacts
from extproc.scheduling import Decision, PickContext, PickRequest, default_scheduler
from extproc.snapshot import build_snapshot, trusted
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.status import format_pools, format_table

PAGE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_text()
NOW = 1000.0
POOLS = (PoolSpec(name="chat", model="tiny"),)


def asleep(page: str, level: int) -> str:
    """The page as vLLM shows it after ``POST /sleep?level=N``."""
    states = {"awake": 0.0, "weights_offloaded": 1.0 if level == 1 else 0.0,
              "discard_all": 1.0 if level == 2 else 0.0}
    for state, value in states.items():
        old = f'sleep_state="{state}"}} {1.0 if state == "awake" else 0.0}'
        assert old in page
        page = page.replace(old, f'sleep_state="{state}"}} {value}')
    return page


def counters(page: str, hits: float, queries: float) -> str:
    page = page.replace('vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 2688.0',
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}')
    return page.replace('vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 5340.0',
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}')


def test_the_real_page_gives_every_fact_the_agent_reads() -> None:
    metrics = parse_engine_metrics(PAGE, "tiny")
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (0, 0, 0.0)
    assert (metrics.kv_block_size, metrics.num_gpu_blocks, metrics.kv_capacity_tokens) == (128, 8192, 1048576)
    assert metrics.sleep_level == 0
    assert (metrics.prefix_cache_hits_total, metrics.prefix_cache_queries_total) == (2688.0, 5340.0)
    assert metrics.waiting_by_reason == (("capacity", 0), ("deferred", 0))
    assert metrics.prompt_tokens_total is not None and metrics.ttft_count is not None
    assert (metrics.inter_token_sum_s, metrics.inter_token_count) == (3.610280408998733, 1290.0)
    assert parse_engine_metrics(PAGE, "other-model").sleep_level is None  # not this model's series


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_is_read_and_announced(level: int) -> None:
    awake = live_fields(parse_engine_metrics(PAGE, "tiny"), RateState(), None)
    sleeping = live_fields(parse_engine_metrics(asleep(PAGE, level), "tiny"), RateState(), None)
    assert (awake["sleep_level"], sleeping["sleep_level"]) == (0, level)
    assert sleeping["waiting"] == 0 and sleeping["kv_usage"] == 0.0  # it looks idle: the trap
    assert notable_change(awake, sleeping) and notable_change(sleeping, awake)


def record(worker_id: str, page: str, **identity: object) -> WorkerRecord:
    base = WorkerRecord(id=worker_id, pool="chat", model="tiny", host="127.0.0.1", port=8000 + len(worker_id),
                        backend="vllm", updated_at=NOW, metrics_at=NOW, **identity)  # type: ignore[arg-type]
    live = live_fields(parse_engine_metrics(page, "tiny"), RateState(), None)
    return WorkerRecord.from_redis({**base.to_redis(), **{k: str(v) for k, v in live.items()}})


def pick(*workers: WorkerRecord) -> object:
    snapshot = build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3.0)
    request = PickRequest(RequestFacts("/v1/chat/completions", "POST", "tiny"), 50, 10, 10, "short_chat")
    return default_scheduler(random.Random(0), SchedulingSettings()).pick(request, PickContext(snapshot, {}))


def test_a_sleeping_worker_gets_no_request_until_it_wakes() -> None:
    awake, sleeping = record("awake", PAGE), record("sleeping", asleep(PAGE, 1))
    assert sleeping.sleep_level == 1
    for _ in range(20):  # the sleeper looks emptier (no in-flight here), yet never wins
        outcome = pick(sleeping, awake)
        assert isinstance(outcome, Decision) and outcome.worker_id == "awake"
    alone = pick(sleeping)
    assert not isinstance(alone, Decision) and alone.code == "no_ready_worker"  # type: ignore[attr-defined]
    woken = record("sleeping", PAGE)
    outcome = pick(woken)
    assert isinstance(outcome, Decision) and outcome.worker_id == "sleeping"


def test_a_stale_sleep_reading_is_forgotten_like_every_agent_fact() -> None:
    sleeping = record("sleeping", asleep(PAGE, 2))
    assert trusted(sleeping, oldest=NOW + 1).sleep_level == 0


def test_the_prefix_cache_hit_rate_is_read_per_interval() -> None:
    first = advance(RateState(), parse_engine_metrics(PAGE, "tiny"), 0.0)
    assert first.prefix_cache_hit_rate == -1.0  # one reading: no interval yet
    second = advance(first, parse_engine_metrics(counters(PAGE, 2688 + 900, 5340 + 1000), "tiny"), 0.25)
    assert second.prefix_cache_hit_rate == pytest.approx(0.9)
    fields = live_fields(parse_engine_metrics(PAGE, "tiny"), second, None)
    assert fields["prefix_cache_hit_rate"] == 0.9
    idle = advance(second, parse_engine_metrics(counters(PAGE, 3588, 6340), "tiny"), 0.5)
    assert idle.prefix_cache_hit_rate == pytest.approx(0.9)  # nothing looked up: the last rate stands
    restarted = advance(idle, parse_engine_metrics(counters(PAGE, 10, 20), "tiny"), 0.75)
    assert restarted.prefix_cache_hit_rate == pytest.approx(0.9)  # counters reset: a new baseline


def test_requests_deferred_by_a_transient_constraint_are_counted_apart() -> None:
    page = PAGE.replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0')
    page = page.replace('reason="capacity"} 0.0', 'reason="capacity"} 3.0')
    page = page.replace('reason="deferred"} 0.0', 'reason="deferred"} 2.0')
    fields = live_fields(parse_engine_metrics(page, "tiny"), RateState(), None)
    assert (fields["waiting"], fields["waiting_deferred"]) == (5, 2)


def test_status_shows_sleep_deferred_requests_and_hit_rate() -> None:
    sleeping = record("sleeping", asleep(PAGE, 1)).with_live(waiting=3, waiting_deferred=2,
                                                              prefix_cache_hit_rate=0.5)
    awake = record("awake", PAGE)
    table = format_table([sleeping, awake], {}, NOW).splitlines()
    assert "prefix hits" in table[0]
    assert "Ready (asleep, level 1)" in table[1] and "3 (2 deferred)" in table[1] and "50%" in table[1]
    assert "(asleep" not in table[2] and " - " in table[2]
    assert format_pools([sleeping, awake], {}).startswith("pool chat: 1/2 serving")
