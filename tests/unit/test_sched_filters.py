"""Each candidate filter on hand-built workers: what it keeps, and what it answers when it keeps nothing."""

from __future__ import annotations

import pytest

from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling import NoCapacity, PickContext, PickRequest
from extproc.scheduling.filters import (
    FitsContext,
    GpuMemoryWatermark,
    KvFits,
    ReadyAndFresh,
    TaskClassPools,
)
from extproc.scheduling.kv import kv_footprint, kv_free_tokens, kv_room_after
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, TaskClass
from poolgate.kernel.fleet import WorkerRecord, WorkerState

NOW = 1_000.0
POOLS = (PoolSpec(name="general", model="llama"), PoolSpec(name="streams", model="llama", task_classes=("streaming",)),
         PoolSpec(name="long", model="llama", task_classes=("long_context",)), PoolSpec(name="code", model="coder"))


def worker(worker_id: str, pool: str = "general", **fields: object) -> WorkerRecord:
    model = next(p.model for p in POOLS if p.name == pool)
    values: dict[str, object] = {"updated_at": NOW, **fields}
    return WorkerRecord(id=worker_id, pool=pool, model=model, host="10.0.0.1", port=1, **values)  # type: ignore[arg-type]


def request(prompt: int = 100, output: int = 100, task_class: TaskClass = "short_chat", model: str = "llama",
            max_tokens: int | None = None, min_prompt: int | None = None) -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", model, max_tokens=max_tokens)
    return PickRequest(facts, prompt, prompt // 2 if min_prompt is None else min_prompt, output, task_class)


def context(*workers: WorkerRecord, reserved: dict[str, int] | None = None) -> PickContext:
    snap: FleetSnapshot = build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3.0)
    return PickContext(snap, {}, reserved_kv_tokens=reserved or {})


def kept(flt: object, req: PickRequest, *workers: WorkerRecord, reserved: dict[str, int] | None = None) -> list[str]:
    ctx = context(*workers, reserved=reserved)
    return [w.id for w in flt.filter(req, list(workers), ctx)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("task_class", "expected"), [
    ("short_chat", ["g"]),
    ("streaming", ["g", "s"]),  # a general pool takes every class
    ("long_context", ["g", "l"]),
])
def test_task_class_pools(task_class: TaskClass, expected: list[str]) -> None:
    workers = (worker("g"), worker("s", "streams"), worker("l", "long"))
    assert kept(TaskClassPools(), request(task_class=task_class), *workers) == expected


def test_task_class_falls_back_to_every_pool_of_the_model_when_none_takes_the_class() -> None:
    workers = (worker("s", "streams"), worker("l", "long"))
    assert kept(TaskClassPools(), request(task_class="short_chat"), *workers) == ["s", "l"]


def test_task_class_is_free_for_models_without_restricted_pools() -> None:
    workers = [worker("c", "code")]
    ctx = context(*workers)
    assert TaskClassPools().filter(request(model="coder"), workers, ctx) is workers


@pytest.mark.parametrize(("state", "age_s", "keep"), [
    (WorkerState.READY, 0.0, True),
    (WorkerState.READY, 2.9, True),
    (WorkerState.READY, 3.5, False),
    (WorkerState.BUSY, 0.0, False),
    (WorkerState.DRAINING, 0.0, False),
    (WorkerState.FAILED, 0.0, False),
    (WorkerState.STARTING, 0.0, False),
])
def test_ready_and_fresh(state: WorkerState, age_s: float, keep: bool) -> None:
    assert kept(ReadyAndFresh(), request(), worker("w", state=state, updated_at=NOW - age_s)) == (["w"] if keep else [])
    refusal = ReadyAndFresh(retry_after_s=4).rejection(request(), context())
    assert isinstance(refusal, ApiError) and (refusal.status, refusal.retry_after_s) == (503, 4)


def test_a_model_whose_workers_are_all_busy_is_waited_for_and_one_nobody_serves_is_refused() -> None:
    busy = worker("w", state=WorkerState.BUSY, updated_at=NOW)
    held = ReadyAndFresh(retry_after_s=2).rejection(request(), context(busy))
    assert isinstance(held, NoCapacity) and (held.reason, held.retry_after_s) == ("busy", 2)
    for gone in (worker("w", state=WorkerState.BUSY, updated_at=NOW - 3.5), worker("w", state=WorkerState.FAILED),
                 worker("w", state=WorkerState.BUSY, updated_at=NOW, sleep_level=1)):
        refusal = ReadyAndFresh().rejection(request(), context(gone))
        assert isinstance(refusal, ApiError) and refusal.code == "no_ready_worker", gone


def test_fits_context_prefers_workers_that_hold_the_expected_size() -> None:
    small, large = worker("small", max_model_len=1000), worker("large", max_model_len=4000)
    assert kept(FitsContext(), request(prompt=500, output=256), small, large) == ["small", "large"]
    assert kept(FitsContext(), request(prompt=900, output=256), small, large) == ["large"]


def test_fits_context_falls_back_to_what_the_engine_accepts() -> None:
    small = worker("small", max_model_len=1000)
    # estimate 900 + 256 does not fit, but the lower bound (450) + one token does: the engine caps the output
    assert kept(FitsContext(), request(prompt=900, output=256), small) == ["small"]
    # the client asked for 600 tokens: 450 + 600 > 1000 even at the lower bound
    assert kept(FitsContext(), request(prompt=900, output=600, max_tokens=600), small) == []
    error = FitsContext().rejection(request(prompt=900, output=600, max_tokens=600), context(small))
    assert isinstance(error, ApiError)
    assert (error.status, error.code) == (400, "context_length_exceeded") and "1050" in error.message


@pytest.mark.parametrize(("free_mib", "floor", "keep"), [
    (-1.0, 2048.0, True),  # unknown: kept
    (4096.0, 2048.0, True),
    (1024.0, 2048.0, False),
    (1024.0, 0.0, True),  # watermark off
])
def test_gpu_memory_watermark(free_mib: float, floor: float, keep: bool) -> None:
    flt = GpuMemoryWatermark(floor, retry_after_s=2)
    assert kept(flt, request(), worker("w", gpu_memory_free_mib=free_mib)) == (["w"] if keep else [])
    assert flt.rejection(request(), context()) == NoCapacity("llama", "gpu-memory", 2)


@pytest.mark.parametrize(("tokens", "block", "expected"), [(200, 16, 208), (208, 16, 208), (1, 16, 16), (5, 0, 5)])
def test_kv_footprint_is_whole_blocks(tokens: int, block: int, expected: int) -> None:
    assert kv_footprint(request(prompt=tokens, output=0).total_tokens, block) == expected


def test_kv_free_tokens_formula() -> None:
    assert kv_free_tokens(worker("w", kv_capacity_tokens=10_000, kv_usage=0.5), 0.1, 1000) == pytest.approx(3000)


def test_kv_room_after_is_the_free_tokens_less_the_footprint_as_a_share_of_capacity() -> None:
    workers = [worker(f"w{i}", kv_capacity_tokens=capacity, kv_usage=usage, kv_block_size=block)
               for i, (capacity, usage, block) in enumerate([(10_000, 0.5, 16), (8_000, 0.9, 32), (50_000, 0.0, 0),
                                                              (0, 0.3, 16)])]
    reserved = {"w0": 1000, "w2": 7}
    room = kv_room_after(workers, 1_001, 0.1, reserved)
    expected = [(kv_free_tokens(w, 0.1, reserved.get(w.id, 0)) - kv_footprint(1_001, w.kv_block_size))
                / w.kv_capacity_tokens for w in workers[:3]]
    assert room == pytest.approx([*expected, 0.0])  # unknown capacity: 0.0
    assert room[1] < 0 <= room[0]  # the second does not fit


@pytest.mark.parametrize(("usage", "reserved", "prompt", "keep"), [
    (0.0, 0, 1000, True),
    (0.9, 0, 1000, False),  # 10 000 × (1 − 0.9 − 0.02) = 800 free < 1008
    (0.8, 0, 1000, True),  # 1800 free
    (0.8, 900, 1000, False),  # what extproc placed since the record counts too
    (0.0, 0, 50_000, True),  # larger than the whole worker: needs only an empty worker
    (0.1, 0, 50_000, False),
])
def test_kv_fits(usage: float, reserved: int, prompt: int, keep: bool) -> None:
    w = worker("w", kv_capacity_tokens=10_000, kv_usage=usage)
    flt = KvFits(0.02)
    assert kept(flt, request(prompt=prompt, output=0), w, reserved={"w": reserved}) == (["w"] if keep else [])
    assert flt.rejection(request(), context()) == NoCapacity("llama", "kv-fits", 1)


def test_kv_fits_keeps_workers_of_unknown_capacity() -> None:
    assert kept(KvFits(0.02), request(prompt=10**6), worker("w", kv_capacity_tokens=0, kv_usage=1.0)) == ["w"]
