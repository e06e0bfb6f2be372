"""The saturation gate: class-dependent load limits, the waiting rule, and the scheduler's NoCapacity."""

from __future__ import annotations

import random

import pytest

from extproc.request import RequestFacts
from extproc.scheduling import NoCapacity, PickContext, PickRequest, build_scheduler
from extproc.scheduling.saturation import SaturationGate
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord

NOW = 1_000.0
POOLS = (PoolSpec(name="general", model="llama"),)


def worker(worker_id: str, running: int = 0, waiting: int = 0) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="general", model="llama", host="10.0.0.1", port=int(worker_id[-1]) + 1,
                        running=running, waiting=waiting, kv_capacity_tokens=100_000, updated_at=NOW,
                        metrics_at=NOW)


def request(priority: int) -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", "llama", max_tokens=16)
    return PickRequest(facts, 100, 50, 16, "short_chat", priority=priority)


def context(*workers: WorkerRecord, inflight: dict[str, int] | None = None) -> PickContext:
    return PickContext(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3.0), inflight or {})


def kept(gate: SaturationGate, priority: int, *workers: WorkerRecord,
         inflight: dict[str, int] | None = None) -> list[str]:
    return [w.id for w in gate.filter(request(priority), list(workers), context(*workers, inflight=inflight))]


@pytest.mark.parametrize(("priority", "expected"), [
    (0, ["w1", "w2"]),  # the highest class may fill to 8
    (1, ["w1"]),        # lower classes only to 8 × 0.5 = 4
    (2, ["w1"]),
])
def test_lower_classes_leave_headroom_for_the_highest(priority: int, expected: list[str]) -> None:
    gate = SaturationGate(8, lower_class_fraction=0.5)
    workers = (worker("w1", running=3), worker("w2", running=5), worker("w3", running=8))
    assert kept(gate, priority, *workers) == expected


def test_load_is_the_larger_of_engine_and_extproc_counts() -> None:
    """Placements the agent has not scraped yet count through extproc's in-flight."""
    gate = SaturationGate(4)
    workers = (worker("w1", running=1), worker("w2", running=1, waiting=3))
    assert kept(gate, 0, *workers, inflight={"w1": 4}) == []
    assert kept(gate, 0, *workers, inflight={"w1": 3}) == ["w1"]


def test_queue_when_waiting_holds_only_lower_classes() -> None:
    gate = SaturationGate(0, queue_when_waiting=True)
    workers = (worker("w1", waiting=1), worker("w2"))
    assert kept(gate, 1, *workers) == ["w2"]
    assert kept(gate, 0, *workers) == ["w1", "w2"]


def test_a_tiny_fraction_still_allows_one_request() -> None:
    assert SaturationGate(2, lower_class_fraction=0.1).limit(1) == 1.0
    assert SaturationGate(0).limit(1) == 0.0


def test_the_scheduler_answers_no_capacity_so_the_queue_holds_the_request() -> None:
    settings = SchedulingSettings(max_inflight_per_worker=4, lower_class_inflight_fraction=0.5)
    scheduler = build_scheduler(settings, random.Random(1))
    ctx = context(worker("w1", running=2), worker("w2", running=3))
    refused = scheduler.pick(request(2), ctx)
    assert isinstance(refused, NoCapacity) and refused.reason == "saturated"
    assert not isinstance(scheduler.pick(request(0), ctx), NoCapacity)


def test_the_default_settings_add_no_gate() -> None:
    assert not any(isinstance(f, SaturationGate) for f in build_scheduler(SchedulingSettings()).filters)
