"""Learned output lengths: a high quantile of what answers really used, bounded by max_tokens, sizes the KV
reservation, so the KV filter admits work the cap would refuse, and the simulated engine runs it all without
a preemption."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.output_lengths import OutputLengths
from extproc.request import RequestFacts
from extproc.scheduling import PickContext, PickRequest
from extproc.scheduling.filters import KvFits
from extproc.scheduling.kv import kv_footprint
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from simworker import protocol
from simworker.engine import Engine, EngineConfig, EngineRequest
from tests.unit.test_sim_engine import COST, VirtualClock

MODEL = "sim-llama-3-8b"
CAP = 2048
"""What a client sets to be safe; the answers are mostly far shorter."""


def pick_request(max_tokens: int | None, output: int, task_class: str = "short_chat") -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", MODEL, max_tokens=max_tokens)
    return PickRequest(facts, 500, 500, output, task_class)  # type: ignore[arg-type]


def test_the_quantile_of_recent_lengths_replaces_the_cap_but_never_exceeds_it() -> None:
    lengths = OutputLengths(quantile=0.9, window=100, min_samples=10, tenant_min_samples=20)
    assert lengths.refine(pick_request(CAP, CAP), "acme").output_tokens == CAP  # nothing learned yet
    for length in range(1, 101):
        lengths.observe(MODEL, "short_chat", "acme", length)
    assert lengths.expected(MODEL, "short_chat", "acme") == 91
    assert lengths.refine(pick_request(CAP, CAP), "acme").output_tokens == 91
    assert lengths.refine(pick_request(40, 40), "acme").output_tokens == 40  # max_tokens bounds it
    assert lengths.refine(pick_request(None, 256), "acme").output_tokens == 91  # no cap: the learned length
    assert lengths.refine(pick_request(CAP, CAP, "long_context"), "acme").output_tokens == CAP  # other class


def test_a_tenant_gets_its_own_lengths_only_with_enough_of_them() -> None:
    lengths = OutputLengths(quantile=0.5, window=1000, min_samples=10, tenant_min_samples=20)
    for _ in range(30):
        lengths.observe(MODEL, "short_chat", "chatty", 900)
    for _ in range(10):
        lengths.observe(MODEL, "short_chat", "terse", 10)
    assert lengths.expected(MODEL, "short_chat", "chatty") == 900
    assert lengths.expected(MODEL, "short_chat", "terse") == 900  # 10 of its own: the model's lengths
    for _ in range(10):
        lengths.observe(MODEL, "short_chat", "terse", 10)
    assert lengths.expected(MODEL, "short_chat", "terse") == 10


def test_the_window_forgets_old_lengths_and_sampling_is_bounded() -> None:
    lengths = OutputLengths(quantile=0.5, window=10, min_samples=5, sample_every=4)
    for length in [1000] * 10 + [50] * 10:
        lengths.observe(MODEL, "short_chat", "t", length)
    assert lengths.expected(MODEL, "short_chat", "t") == 50
    assert sum(lengths.wants_sample() for _ in range(100)) == 25
    assert not any(OutputLengths().wants_sample() for _ in range(10))  # 0: only responses read anyway


def chat_body(index: int) -> dict[str, object]:
    text = " ".join(f"topic{index} word{j}" for j in range(200))
    return {"model": MODEL, "max_tokens": CAP, "messages": [{"role": "user", "content": text}]}


def engine_request(index: int) -> EngineRequest:
    """The request as the simulated worker plans it: its natural length, capped by max_tokens."""
    generation = protocol.parse_chat(chat_body(index))
    plan = protocol.plan_generation(generation, 8192, MODEL)
    return EngineRequest(f"r{index}", plan.prompt_tokens, plan.output_target, plan.finish_reason)


def admitted(requests: Sequence[PickRequest], capacity_tokens: int) -> int:
    """How many of a burst extproc's KV filter places on one empty worker, reserving each one's footprint."""
    worker = WorkerRecord(id="w", pool="chat", model=MODEL, host="h", port=1, kv_capacity_tokens=capacity_tokens,
                          updated_at=0.0)
    snapshot = build_snapshot([worker], (PoolSpec(name="chat", model=MODEL),), 0.0, 3.0)
    kv_filter = KvFits(0.0)
    reserved = 0
    for count, request in enumerate(requests):
        if not kv_filter.filter(request, [worker], PickContext(snapshot, {}, {"w": reserved})):
            return count
        reserved += kv_footprint(request.total_tokens, worker.kv_block_size)
    return len(requests)


def test_learned_lengths_admit_more_of_a_burst_and_the_engine_runs_it_without_preemption() -> None:
    lengths = OutputLengths(quantile=0.95, min_samples=50)
    for index in range(1000, 1300):  # earlier answers, as the workers' usage reported them
        lengths.observe(MODEL, "short_chat", "acme", engine_request(index).output_target)
    burst = [engine_request(index) for index in range(60)]
    as_capped = [pick_request(CAP, CAP) for _ in burst]
    as_learned = [lengths.refine(pick_request(CAP, CAP), "acme") for _ in burst]
    for request, planned in zip(as_capped, burst, strict=True):
        assert request.prompt_tokens >= planned.prompt_tokens - 100  # the estimate is near the real prompt
    capacity = 16 * 1024
    by_cap, by_learned = admitted(as_capped, capacity), admitted(as_learned, capacity)
    print(f"admitted at once: {by_cap} reserving max_tokens, {by_learned} reserving the learned p95 "
          f"({as_learned[0].output_tokens} tokens)")
    assert by_learned >= by_cap * 3 // 2  # the p95 of a chat mix with a long-form tail: half as much again
    engine = Engine(EngineConfig(num_gpu_blocks=capacity // 16, block_size=16, max_num_seqs=256,
                                 max_num_batched_tokens=2048, max_model_len=8192, enable_prefix_caching=False,
                                 cost=COST))
    clock = VirtualClock(engine)
    for request in burst[:by_learned]:
        engine.add_request(request, now=0.0)
    clock.run_until_idle()
    finished = [f for outcome in clock.outcomes for f in outcome.finished]
    assert sum(outcome.preemptions for outcome in clock.outcomes) == 0
    assert len(finished) == by_learned and all(f.reason in ("stop", "length") for f in finished)
