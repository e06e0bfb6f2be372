"""Hostile input to the estimator and the picker: any parsed request over any fleet snapshot gives a decision
(a worker that may take it), a no-capacity refusal (held, then 429) or an OpenAI-style error, never an
exception; and what a client sends never moves the decision off the workers the rules allow."""

from __future__ import annotations

import random

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.endpoints import CHAT_PATH, COMPLETIONS_PATH
from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling import Decision, NoCapacity, PickContext, RequestProfiler, build_scheduler
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings, TaskClassRules
from poolgate.kernel.fleet import WorkerRecord, WorkerState

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = 10_000.0
POOLS = (PoolSpec(name="chat", model="llama", max_model_len=8192),
         PoolSpec(name="long", model="llama", max_model_len=131072),
         PoolSpec(name="streams", model="llama", task_classes=("streaming",)),
         PoolSpec(name="code", model="coder", max_model_len=4096))
MODELS = ("llama", "coder", "unknown-model", "", "llama\x00", "pool-chat", "x" * 300)

facts = st.builds(
    RequestFacts,
    path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]),
    method=st.just("POST"),
    model=st.sampled_from(MODELS),
    stream=st.booleans(),
    max_tokens=st.one_of(st.none(), st.integers(min_value=1, max_value=2**63 - 1)),
    prompt_chars=st.integers(min_value=0, max_value=10**9),
    prompt_token_ids=st.integers(min_value=0, max_value=10**7),
    message_count=st.integers(min_value=0, max_value=100_000),
    prompt_parts=st.lists(st.text(max_size=600), max_size=4).map(tuple),
    session_id=st.text(max_size=20),
    client_routing_headers=st.lists(st.sampled_from(["x-poolgate-cluster", "x-gateway-destination-endpoint"]),
                                    max_size=2).map(tuple),
)
live_number = st.floats()
"""Live facts come from engines' metrics through Redis: NaN and infinities are possible."""
workers = st.builds(
    WorkerRecord,
    id=st.text("abcdefgh", min_size=1, max_size=6),
    pool=st.sampled_from(["chat", "long", "streams", "code", "unconfigured"]),
    model=st.sampled_from(["llama", "coder"]),
    host=st.just("10.0.0.1"),
    port=st.integers(min_value=1, max_value=65535),
    served_names=st.lists(st.sampled_from(MODELS), max_size=2).map(tuple),
    max_model_len=st.integers(min_value=1, max_value=10**6),
    state=st.sampled_from(list(WorkerState)),
    kv_capacity_tokens=st.integers(min_value=-5, max_value=10**8),
    kv_block_size=st.integers(min_value=0, max_value=256),
    kv_usage=st.one_of(st.floats(min_value=0, max_value=1), live_number),
    running=st.integers(min_value=0, max_value=10**4),
    waiting=st.integers(min_value=0, max_value=10**4),
    ttft_ewma_s=live_number,
    prefill_tokens_per_s=live_number,
    gpu_memory_total_mib=live_number,
    gpu_memory_free_mib=live_number,
    gpu_utilization=live_number,
    updated_at=st.floats(min_value=NOW - 100, max_value=NOW + 5),
    metrics_at=st.floats(min_value=0, max_value=NOW + 5),
)
weights = st.fixed_dictionaries({name: st.floats(min_value=0, max_value=10) for name in
                                 ("predicted_ttft", "kv_headroom", "inflight", "prefix_affinity")})


def scheduling_settings(weights: dict[str, float], debug: bool) -> SchedulingSettings:
    return SchedulingSettings(weights=weights, debug_header=debug,
                              task_classes=TaskClassRules(long_context_min_tokens=4000, code_models=("coder",)))


@FAST
@given(facts, weights, st.booleans())
def test_estimates_are_sane_for_any_request(request_facts: RequestFacts, weights: dict[str, float],
                                            debug: bool) -> None:
    profiled = RequestProfiler(scheduling_settings(weights, debug)).profile(request_facts)
    assert 0 <= profiled.min_prompt_tokens <= profiled.prompt_tokens
    assert profiled.output_tokens >= 1
    assert profiled.task_class in ("short_chat", "long_context", "code_completion", "streaming")


@FAST
@given(facts, st.lists(workers, max_size=8, unique_by=lambda w: w.id), weights, st.booleans(),
       st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), st.integers(-10, 10**6), max_size=4),
       st.integers(0, 2**32))
def test_any_pick_is_a_decision_or_a_refusal(request_facts: RequestFacts, fleet: list[WorkerRecord],
                                             weights: dict[str, float], debug: bool, reserved: dict[str, int],
                                             seed: int) -> None:
    settings_ = scheduling_settings(weights, debug)
    request = RequestProfiler(settings_).profile(request_facts)
    snapshot = build_snapshot(fleet, POOLS, NOW, 3.0)
    context = PickContext(snapshot, dict(reserved), reserved_kv_tokens=reserved,
                          affinity={key: fleet[0].id for key in request.affinity_keys[:2]} if fleet else {})
    outcome = build_scheduler(settings_, random.Random(seed)).pick(request, context)
    if isinstance(outcome, Decision):
        chosen = snapshot.by_id[outcome.worker_id]
        # Only a Ready, fresh worker of a configured pool serving the model, never one the client named.
        assert chosen.state is WorkerState.READY and snapshot.is_fresh(chosen)
        assert request.model in chosen.names or POOLS[[p.name for p in POOLS].index(chosen.pool)].model == request.model
        assert outcome.cluster == f"pool-{chosen.pool}" and outcome.endpoint == chosen.address
        assert all(0.0 <= score <= 1.0 for _, score in outcome.scores), outcome.scores
    elif isinstance(outcome, ApiError):
        error = orjson.loads(outcome.body())["error"]
        assert 400 <= outcome.status < 600 and error["message"] and error["type"]
    else:
        assert isinstance(outcome, NoCapacity) and outcome.retry_after_s >= 1
