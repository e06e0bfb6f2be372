"""The pick over hand-built snapshots: only Ready and fresh workers, fewest in flight, clear errors."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling import Decision, PickContext, PickRequest, RequestProfiler, default_scheduler
from extproc.scheduling.picker import MaxScore
from extproc.scheduling.plugins import NoCapacity, SameScore
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.least_inflight import LeastInflight
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState

NOW = 1_000_000.0
POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="chat-big", model="llama"),
         PoolSpec(name="code", model="coder"), PoolSpec(name="empty", model="ghost"))


def worker(worker_id: str, pool: str = "chat", state: WorkerState = WorkerState.READY, age_s: float = 0.0,
           port: int = 8000, **extra: object) -> WorkerRecord:
    model = next(p.model for p in POOLS if p.name == pool)
    return WorkerRecord(id=worker_id, pool=pool, model=model, host="10.0.0.1", port=port, state=state,
                        updated_at=NOW - age_s, **extra)  # type: ignore[arg-type]


def snapshot(*workers: WorkerRecord) -> FleetSnapshot:
    return build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3.0)


def facts(model: str = "llama", **extra: object) -> PickRequest:
    parsed = RequestFacts("/v1/chat/completions", "POST", model, **extra)  # type: ignore[arg-type]
    return RequestProfiler(SchedulingSettings()).profile(parsed)


def pick(snap: FleetSnapshot, inflight: dict[str, int] | None = None, model: str = "llama", **extra: object) -> (
        object):
    return default_scheduler(random.Random(7)).pick(facts(model, **extra), PickContext(snap, inflight or {}))


def test_routes_to_the_only_ready_worker() -> None:
    decision = pick(snapshot(worker("a", port=8001)))
    assert decision == Decision("a", "chat", "pool-chat", "10.0.0.1:8001")
    assert isinstance(decision, Decision) and decision.pin == "10.0.0.1:8001"


@pytest.mark.parametrize("state", [WorkerState.DRAINING, WorkerState.FAILED, WorkerState.STARTING,
                                   WorkerState.BUSY])
def test_never_pins_a_worker_that_is_not_ready(state: WorkerState) -> None:
    snap = snapshot(worker("bad", state=state, port=1), worker("good", port=2))
    for _ in range(20):
        decision = pick(snap, {"good": 50})
        assert isinstance(decision, Decision) and decision.worker_id == "good" and "1" not in decision.fallbacks
    only_bad = pick(snapshot(worker("bad", state=state)))
    if state is WorkerState.BUSY:  # healthy and full: the request waits in the queue for it
        assert isinstance(only_bad, NoCapacity) and only_bad.reason == "busy" and only_bad.retry_after_s
    else:
        assert isinstance(only_bad, ApiError) and only_bad.status == 503 and only_bad.retry_after_s


def test_never_pins_a_stale_worker() -> None:
    snap = snapshot(worker("old", age_s=3.5, port=1), worker("fresh", age_s=2.9, port=2))
    decision = pick(snap, {"fresh": 9})
    assert isinstance(decision, Decision) and decision.worker_id == "fresh" and decision.fallbacks == ()
    assert snap.stale_workers == 1


def test_least_inflight_wins_and_fallbacks_follow_in_order() -> None:
    snap = snapshot(worker("a", port=1), worker("b", port=2), worker("c", port=3), worker("d", port=4))
    decision = pick(snap, {"a": 3, "b": 0, "c": 1, "d": 2})
    assert isinstance(decision, Decision)
    assert decision.worker_id == "b"
    assert decision.pin == "10.0.0.1:2,10.0.0.1:3,10.0.0.1:4"


def test_fallbacks_stay_in_the_chosen_pool() -> None:
    snap = snapshot(worker("a", port=1), worker("big", pool="chat-big", port=2))
    decision = pick(snap, {"a": 0, "big": 5})
    assert isinstance(decision, Decision) and decision.pool == "chat" and decision.fallbacks == ()


def test_ties_are_spread() -> None:
    snap = snapshot(worker("a", port=1), worker("b", port=2), worker("c", port=3))
    scheduler = default_scheduler(random.Random(1))
    chosen: Counter[str] = Counter()
    for _ in range(300):
        decision = scheduler.pick(facts(), PickContext(snap, {}))
        assert isinstance(decision, Decision)
        chosen[decision.worker_id] += 1
    assert set(chosen) == {"a", "b", "c"} and min(chosen.values()) > 60


def test_inflight_accounting_spreads_back_to_back_picks() -> None:
    snap = snapshot(*(worker(name, port=i) for i, name in enumerate("abcd")))
    scheduler = default_scheduler(random.Random(3))
    inflight: dict[str, int] = {}
    for _ in range(40):
        decision = scheduler.pick(facts(), PickContext(snap, inflight))
        assert isinstance(decision, Decision)
        inflight[decision.worker_id] = inflight.get(decision.worker_id, 0) + 1
    assert inflight == {"a": 10, "b": 10, "c": 10, "d": 10}


@pytest.mark.parametrize(("model", "status", "code"), [
    ("unknown", 404, "model_not_found"),
    ("ghost", 503, "no_ready_worker"),  # configured pool, no worker registered
    ("coder", 503, "no_ready_worker"),  # workers exist, none ready
])
def test_errors(model: str, status: int, code: str) -> None:
    snap = snapshot(worker("a"), worker("c", pool="code", state=WorkerState.DRAINING))
    error = pick(snap, model=model)
    assert isinstance(error, ApiError) and (error.status, error.code) == (status, code)


def test_served_names_are_models_too() -> None:
    snap = snapshot(worker("a", served_names=("llama", "llama-alias")))
    assert "llama-alias" in snap.models and "ghost" in snap.models
    decision = pick(snap, model="llama-alias")
    assert isinstance(decision, Decision) and decision.worker_id == "a"


def test_workers_of_unconfigured_pools_are_ignored() -> None:
    stray = WorkerRecord(id="x", pool="nope", model="llama", host="h", port=1, updated_at=NOW)
    snap = snapshot(stray)
    assert snap.workers == () and isinstance(pick(snap), ApiError)


def test_context_filter() -> None:
    snap = snapshot(worker("small", max_model_len=1000, port=1), worker("large", max_model_len=32000, port=2))
    decision = pick(snap, {"large": 10}, max_tokens=2000)
    assert isinstance(decision, Decision) and decision.worker_id == "large"
    error = pick(snap, prompt_chars=8 * 40_000)
    assert isinstance(error, ApiError) and (error.status, error.code) == (400, "context_length_exceeded")


@pytest.mark.parametrize(("counts", "expected"), [
    ([0, 0, 0], [1.0, 1.0, 1.0]),
    ([0, 5, 10], [1.0, 0.5, 0.0]),
    ([3, 4], [1.0, 0.0]),
])
def test_least_inflight_formula(counts: list[int], expected: list[float]) -> None:
    workers = [worker(str(i)) for i in range(len(counts))]
    context = PickContext(snapshot(*workers), {str(i): n for i, n in enumerate(counts)})
    assert list(LeastInflight().score(facts(), workers, context)) == expected


class _Constant:
    """A scorer that rates every candidate alike, as a list or as ``SameScore``."""

    name = "constant"

    def __init__(self, same: bool) -> None:
        self.same = same

    def score(self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext) -> (
            Sequence[float]):
        return SameScore(len(candidates), 0.7) if self.same else [0.7] * len(candidates)


def test_a_score_every_candidate_gets_alike_changes_no_pick() -> None:
    rng = random.Random(3)
    workers = [worker(f"w{i}", pool="chat" if i % 2 else "chat-big", port=8000 + i) for i in range(12)]
    snap = snapshot(*workers)
    picked = {}
    for same in (False, True):
        scheduler = Scheduler([], [(_Constant(same), 2.0), (LeastInflight(), 1.0)], rng=random.Random(5),
                              picker=MaxScore(random.Random(5)))
        decisions = []
        for _ in range(200):
            inflight = {w.id: rng.randrange(4) for w in workers}
            decisions.append(scheduler.pick(facts(), PickContext(snap, inflight)))
        picked[same] = decisions
        rng.seed(3)
    assert picked[True] == picked[False]
    assert len({d.worker_id for d in picked[True] if isinstance(d, Decision)}) > 3  # the picks do vary


def test_same_score_reads_as_the_list_it_stands_for() -> None:
    same = SameScore(3, 0.5)
    assert list(same) == [0.5] * 3 and len(same) == 3 and same[-1] == 0.5 and list(same[1:]) == [0.5] * 2
    with pytest.raises(IndexError):
        same[3]
