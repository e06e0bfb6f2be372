"""The resource-aware pick end to end over hand-built snapshots: filters, weighted scorers, outcomes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling import Decision, NoCapacity, PickContext, RequestProfiler, build_scheduler
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings, TaskClassRules
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import worker_cluster

NOW = 1_000.0
SETTINGS = SchedulingSettings(task_classes=TaskClassRules(streaming_min_output_tokens=500))
KV_WEIGHTED = SchedulingSettings(weights={"predicted_ttft": 3.0, "kv_headroom": 2.0, "inflight": 1.0})
"""The weighted sum that rates KV headroom (the latency default rates KV only by what a request would evict)."""
POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="streams", model="llama", task_classes=("streaming",)))


def worker(worker_id: str, pool: str = "chat", **fields: object) -> WorkerRecord:
    values: dict[str, object] = {"updated_at": NOW, "kv_capacity_tokens": 100_000, **fields}
    return WorkerRecord(id=worker_id, pool=pool, model="llama", host="10.0.0.1", port=len(worker_id) + 8000,
                        **values)  # type: ignore[arg-type]


def pick(*workers: WorkerRecord, settings: SchedulingSettings = SETTINGS, chars: int = 4000, seed: int = 0,
         reserved: dict[str, int] | None = None, **facts: object) -> object:
    parsed = RequestFacts("/v1/chat/completions", "POST", "llama", prompt_chars=chars, message_count=1,
                          **facts)  # type: ignore[arg-type]
    request = RequestProfiler(settings).profile(parsed)
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}, reserved_kv_tokens=reserved or {})
    return build_scheduler(settings, random.Random(seed)).pick(request, context)


def test_the_fuller_worker_is_avoided() -> None:
    chosen = Counter()
    for seed in range(50):
        decision = pick(worker("empty", kv_usage=0.2), worker("full", kv_usage=0.7), seed=seed, settings=KV_WEIGHTED)
        assert isinstance(decision, Decision)
        chosen[decision.worker_id] += 1
    assert chosen == {"empty": 50}


def test_a_shorter_queue_outweighs_a_little_kv() -> None:
    for settings in (SETTINGS, KV_WEIGHTED):
        decision = pick(worker("queued", kv_usage=0.1, waiting=8), worker("free", kv_usage=0.3), settings=settings)
        assert isinstance(decision, Decision) and decision.worker_id == "free"


def test_no_room_anywhere_is_no_capacity_not_a_full_worker() -> None:
    outcome = pick(worker("a", kv_usage=0.99), worker("b", kv_usage=0.995), chars=40_000)
    assert outcome == NoCapacity("llama", "kv-fits", 1)


def test_own_placements_count_before_the_record_shows_them() -> None:
    outcome = pick(worker("a", kv_usage=0.5), chars=4000, reserved={"a": 48_000})
    assert isinstance(outcome, NoCapacity)


def test_gpu_watermark_gives_no_capacity() -> None:
    settings = SchedulingSettings(gpu_memory_min_free_mib=1024)
    assert pick(worker("a", gpu_memory_free_mib=100.0), settings=settings) == NoCapacity("llama", "gpu-memory", 1)


def test_no_ready_worker_is_503_not_a_wait() -> None:
    outcome = pick(worker("a", state=WorkerState.DRAINING, kv_usage=1.0))
    assert isinstance(outcome, ApiError) and outcome.status == 503


def test_unknown_capacity_is_used_only_when_nothing_better_is_known() -> None:
    decision = pick(worker("unknown", kv_capacity_tokens=0), worker("known", kv_usage=0.3), settings=KV_WEIGHTED)
    assert isinstance(decision, Decision) and decision.worker_id == "known"
    decision = pick(worker("unknown", kv_capacity_tokens=0), worker("full", kv_usage=0.99), chars=40_000)
    assert isinstance(decision, Decision) and decision.worker_id == "unknown"


@pytest.mark.parametrize(("stream", "max_tokens", "pools"), [
    (True, 1000, {"chat", "streams"}),  # a long stream may use the streaming pool
    (True, 100, {"chat"}),  # a short one is a chat: kept out of the streaming pool
    (False, 1000, {"chat"}),
])
def test_streaming_only_pool(stream: bool, max_tokens: int, pools: set[str]) -> None:
    seen = set()
    for seed in range(40):
        decision = pick(worker("c"), worker("s", "streams"), stream=stream, max_tokens=max_tokens, seed=seed)
        assert isinstance(decision, Decision)
        seen.add(decision.pool)
    assert seen == pools


def test_explained_decision_carries_every_weighted_score() -> None:
    settings = SchedulingSettings(debug_header=True, weights={"kv_headroom": 1, "inflight": 0, "predicted_ttft": 2})
    decision = pick(worker("a", kv_usage=0.5), worker("b", kv_usage=0.6), settings=settings)
    assert isinstance(decision, Decision) and decision.worker_id == "a"
    # weight 0 is not run; the rest in the registry's order (the scorer modules by name)
    assert [name for name, _ in decision.scores] == ["kv_headroom", "predicted_ttft"]
    assert all(0 <= score <= 1 for _, score in decision.scores)
    single = pick(worker("a"), settings=settings)
    assert isinstance(single, Decision) and len(single.scores) == 2
    assert pick(worker("a"), worker("b")).scores == ()  # type: ignore[attr-defined]


def test_near_ties_are_spread_not_decided_by_estimation_noise() -> None:
    # Idle, equal workers except that one has reported its prefill rate: a tiny TTFT difference only.
    chosen = Counter()
    for seed in range(60):
        decision = pick(worker("known", prefill_tokens_per_s=40_000.0), worker("default"), chars=40, seed=seed)
        assert isinstance(decision, Decision)
        chosen[decision.worker_id] += 1
    assert set(chosen) == {"known", "default"} and min(chosen.values()) > 15


def test_a_sharded_pool_names_the_picked_workers_shard_and_keeps_its_fallbacks_in_it() -> None:
    """Envoy pins only to hosts of the cluster the header names: the decision names the picked worker's shard
    (as the controller built it), and every fallback is of that shard."""
    pools = (PoolSpec(name="chat", model="llama", endpoint_shards=4),)
    workers = [WorkerRecord(id=f"w{i:02d}", pool="chat", model="llama", host="10.0.0.1", port=9000 + i,
                            updated_at=NOW, kv_capacity_tokens=100_000, kv_usage=0.1) for i in range(40)]
    request = RequestProfiler(SETTINGS).profile(RequestFacts("/v1/chat/completions", "POST", "llama",
                                                             prompt_chars=400, message_count=1))
    context = PickContext(build_snapshot(workers, pools, NOW, 3.0), {})
    by_address = {w.address: w for w in workers}
    clusters = set()
    for seed in range(20):
        decision = build_scheduler(SETTINGS, random.Random(seed)).pick(request, context)
        assert isinstance(decision, Decision)
        assert decision.cluster == worker_cluster("chat", decision.worker_id, 4)
        assert len(decision.fallbacks) == 2
        assert {worker_cluster("chat", by_address[a].id, 4) for a in decision.fallbacks} == {decision.cluster}
        clusters.add(decision.cluster)
    assert len(clusters) > 1  # picks are not confined to one shard
