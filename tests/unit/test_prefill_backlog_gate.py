"""The prefill-backlog gate: queued prefill beyond the bound (loosened by the time already held) keeps a worker
from taking a request; an idle worker always takes it; a cached prompt passes where an uncached one waits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from extproc.kvcache.blocks import PromptBlocks
from extproc.request import RequestFacts
from extproc.scheduling import NoCapacity, PickContext, PickRequest, build_scheduler
from extproc.scheduling.backlog import PrefillBacklogGate
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord

NOW = 1_000.0
POOLS = (PoolSpec(name="general", model="llama"),)
RATE = 10_000.0


def worker(worker_id: str, waiting: int = 0) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="general", model="llama", host="10.0.0.1", port=int(worker_id[-1]) + 1,
                        waiting=waiting, kv_capacity_tokens=1_000_000, prefill_tokens_per_s=RATE,
                        updated_at=NOW, metrics_at=NOW)


def request(prompt_tokens: int, held_s: float = 0.0, blocks: PromptBlocks | None = None) -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", "llama", max_tokens=16)
    return PickRequest(facts, prompt_tokens, prompt_tokens // 2, 16, "short_chat", held_s=held_s,
                       prompt_blocks=blocks)


class CachedView:
    """Stands in for the KV-event index: fixed cached-prefix lengths per worker."""

    def __init__(self, cached: Mapping[str, int]) -> None:
        self.cached = cached

    def cached_tokens(self, blocks: PromptBlocks, candidates: Sequence[WorkerRecord]) -> Mapping[str, int]:
        return {w.id: self.cached[w.id] for w in candidates if w.id in self.cached}


def context(*workers: WorkerRecord, pending: dict[str, int] | None = None,
            view: CachedView | None = None) -> PickContext:
    return PickContext(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3.0), {},
                       pending_prefill_tokens=pending or {}, prefix_cache=view)


def kept(gate: PrefillBacklogGate, pick: PickRequest, ctx: PickContext) -> list[str]:
    return [w.id for w in gate.filter(pick, list(ctx.snapshot.workers_for("llama")), ctx)]


def test_idle_workers_always_take_a_long_prompt() -> None:
    gate = PrefillBacklogGate(0.25, RATE)
    assert kept(gate, request(50_000), context(worker("w1"), worker("w2"))) == ["w1", "w2"]


def test_a_backlogged_worker_waits_and_the_bound_loosens_with_the_wait() -> None:
    """backlog(w) = (waiting × P + pending) / rate: w1 (1 × 4000 + 0) / 10k = 0.4 s; w2 (0 + 1000) / 10k = 0.1 s."""
    gate = PrefillBacklogGate(0.25, RATE)
    ctx = context(worker("w1", waiting=1), worker("w2"), pending={"w2": 1000})
    assert kept(gate, request(4000), ctx) == ["w2"]
    busy = context(worker("w1", waiting=1), worker("w2", waiting=2))
    assert kept(gate, request(4000), busy) == []
    assert kept(gate, request(4000, held_s=0.2), busy) == ["w1"]
    assert kept(gate, request(4000, held_s=0.6), busy) == ["w1", "w2"]


def test_a_short_request_passes_where_a_long_one_is_held() -> None:
    gate = PrefillBacklogGate(0.25, RATE)
    ctx = context(worker("w1", waiting=2))
    assert kept(gate, request(6000), ctx) == []
    assert kept(gate, request(100), ctx) == ["w1"]


def test_a_cached_prompt_counts_only_its_uncached_part() -> None:
    gate = PrefillBacklogGate(0.25, RATE)
    blocks = PromptBlocks(6000, {16: tuple(range(375))})
    ctx = context(worker("w1", waiting=2), worker("w2", waiting=2), view=CachedView({"w1": 5900}))
    assert kept(gate, request(6000, blocks=blocks), ctx) == ["w1"]


def test_the_scheduler_answers_no_capacity_so_the_request_is_held() -> None:
    settings = SchedulingSettings(max_prefill_backlog_s=0.25)
    scheduler = build_scheduler(settings)
    outcome = scheduler.pick(request(6000), context(worker("w1", waiting=3)))
    assert isinstance(outcome, NoCapacity) and outcome.reason == "prefill-backlog"
    assert not isinstance(scheduler.pick(request(6000), context(worker("w1"))), NoCapacity)


def test_off_by_default() -> None:
    scheduler = build_scheduler(SchedulingSettings())
    assert not isinstance(scheduler.pick(request(6000), context(worker("w1", waiting=30))), NoCapacity)
