"""The simulated engine's scheduling, driven by a virtual clock (no sockets, no sleeping)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from simworker.engine import Engine, EngineConfig, EngineRequest, FinishReason, StepOutcome
from simworker.presets import StepCost

COST = StepCost(fixed_s=0.01, per_scheduled_token_s=0.0001, per_context_token_s=0.0)


def make_engine(num_gpu_blocks: int = 1000, block_size: int = 16, max_num_seqs: int = 64,
                max_num_batched_tokens: int = 512, max_model_len: int = 2048,
                enable_prefix_caching: bool = False) -> Engine:
    return Engine(EngineConfig(
        num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, cost=COST,
    ))


def request(request_id: str, prompt: int, output: int, reason: FinishReason = "length",
            hashes: tuple[int, ...] = ()) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_tokens=prompt, output_target=output,
                         finish_reason_at_target=reason, prompt_block_hashes=hashes)


@dataclass
class VirtualClock:
    """Runs an engine step by step, advancing time by each step's modelled duration."""

    engine: Engine
    now: float = 0.0
    outcomes: list[StepOutcome] = field(default_factory=list)

    def step(self) -> StepOutcome:
        outcome = self.engine.step(self.now)
        self.now = outcome.end
        self.outcomes.append(outcome)
        return outcome

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work:
                return
            self.step()
        raise AssertionError("engine did not drain")

    def first_token_times(self) -> dict[str, float]:
        return {rid: t for outcome in self.outcomes for rid, t in outcome.first_token_times}

    def finished(self) -> dict[str, tuple[str, int]]:
        return {f.request_id: (f.reason, f.output_tokens) for o in self.outcomes for f in o.finished}


def test_single_request_prefills_then_decodes_one_token_per_step() -> None:
    engine = make_engine()
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=100, output=5), now=0.0)
    first = clock.step()
    assert first.scheduled_tokens == 100
    assert first.emitted == ("a",)
    assert first.duration_s == pytest.approx(0.01 + 100 * 0.0001)
    assert first.first_token_times == (("a", pytest.approx(first.duration_s)),)
    for _ in range(4):
        outcome = clock.step()
        assert outcome.scheduled_tokens == 1
    assert clock.finished() == {"a": ("length", 5)}
    assert not engine.has_work
    assert engine.kv.used_blocks == 0


@pytest.mark.parametrize(("prompt", "budget", "steps_to_first_token"), [
    (100, 512, 1), (512, 512, 1), (513, 512, 2), (2000, 512, 4), (2000, 256, 8),
])
def test_chunked_prefill_splits_long_prompts_by_token_budget(prompt: int, budget: int,
                                                             steps_to_first_token: int) -> None:
    engine = make_engine(max_num_batched_tokens=budget)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=prompt, output=2), now=0.0)
    steps = 0
    while "a" not in clock.first_token_times():
        outcome = clock.step()
        assert outcome.scheduled_tokens <= budget
        steps += 1
    assert steps == steps_to_first_token


def test_decode_and_prefill_share_a_step() -> None:
    engine = make_engine(max_num_batched_tokens=256)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=10, output=50), now=0.0)
    clock.step()
    engine.add_request(request("b", prompt=1000, output=5), now=clock.now)
    outcome = clock.step()
    assert outcome.scheduled_tokens == 256  # 1 decode token for a + 255 prefill tokens for b
    assert outcome.emitted == ("a",)


@pytest.mark.parametrize("output", [1, 3, 40])
def test_kv_usage_is_used_over_total_blocks(output: int) -> None:
    engine = make_engine(num_gpu_blocks=200, block_size=16)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=33, output=output), now=0.0)
    clock.step()
    expected_blocks = -(-33 // 16)
    if output > 1:
        assert engine.kv.used_blocks == expected_blocks
        assert engine.kv.usage == pytest.approx(expected_blocks / 200)
    clock.run_until_idle()
    assert engine.kv.usage == 0.0


def test_requests_queue_when_kv_is_full() -> None:
    # 10 blocks of 16 tokens: one 100-token prompt takes 7 blocks, so a second cannot be admitted.
    engine = make_engine(num_gpu_blocks=10, block_size=16, max_model_len=160)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=100, output=10), now=0.0)
    engine.add_request(request("b", prompt=100, output=10), now=0.0)
    clock.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    clock.run_until_idle()
    times = clock.first_token_times()
    assert times["b"] > times["a"]
    queue_times = dict(qt for o in clock.outcomes for qt in o.queue_times)
    assert queue_times["a"] == 0.0
    assert queue_times["b"] > 0.0
    assert sum(o.preemptions for o in clock.outcomes) == 0


def test_max_num_seqs_caps_the_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    clock = VirtualClock(engine)
    for name in "abc":
        engine.add_request(request(name, prompt=10, output=5), now=0.0)
    clock.step()
    assert (engine.num_running, engine.num_waiting) == (2, 1)


def test_decode_without_free_block_preempts_the_newest_sequence() -> None:
    # Two 32-token prompts fill 4 of 5 blocks; decoding past 48 tokens needs a 6th block.
    engine = make_engine(num_gpu_blocks=5, block_size=16, max_model_len=80)
    clock = VirtualClock(engine)
    engine.add_request(request("old", prompt=32, output=40), now=0.0)
    engine.add_request(request("new", prompt=32, output=40), now=0.0)
    clock.step()
    assert engine.num_running == 2
    while sum(o.preemptions for o in clock.outcomes) == 0:
        clock.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    clock.run_until_idle()
    finished = clock.finished()
    assert finished == {"old": ("length", 40), "new": ("length", 40)}
    last_token_step = {rid: i for i, o in enumerate(clock.outcomes) for rid in o.emitted}
    assert last_token_step["old"] < last_token_step["new"]
    assert engine.kv.used_blocks == 0


def test_preempted_sequence_recomputes_prompt_and_output() -> None:
    engine = make_engine(num_gpu_blocks=5, block_size=16, max_model_len=80)
    clock = VirtualClock(engine)
    engine.add_request(request("old", prompt=32, output=40), now=0.0)
    engine.add_request(request("new", prompt=32, output=40), now=0.0)
    clock.run_until_idle()
    generated = sum(o.generation_tokens for o in clock.outcomes)
    assert generated == 80  # recompute does not emit tokens twice
    prefilled = sum(o.scheduled_tokens for o in clock.outcomes) - generated
    assert prefilled > 64  # but the victim's prompt (and its output so far) were prefilled again


def test_ttft_rises_with_load() -> None:
    def mean_ttft(concurrent: int) -> float:
        engine = make_engine(num_gpu_blocks=4000, max_num_batched_tokens=2048)
        clock = VirtualClock(engine)
        for i in range(concurrent):
            engine.add_request(request(f"r{i}", prompt=500, output=50), now=0.0)
        clock.run_until_idle()
        times = clock.first_token_times()
        return sum(times.values()) / len(times)

    ttfts = [mean_ttft(n) for n in (1, 8, 32, 96)]
    assert ttfts == sorted(ttfts)
    assert ttfts[-1] > 10 * ttfts[0]


def test_step_time_grows_with_decode_batch() -> None:
    cost = StepCost(fixed_s=0.007, per_scheduled_token_s=3e-5, per_context_token_s=5e-8)
    batch_1 = cost.step_seconds(1, 1000)
    batch_256 = cost.step_seconds(256, 256_000)
    assert 0.007 < batch_1 < 0.01
    assert batch_256 > 3 * batch_1


def test_prefix_cache_hit_skips_prefill_of_shared_blocks() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    shared = tuple(range(1, 21))  # 20 full blocks = 320 tokens of common prefix
    engine.add_request(request("a", prompt=330, output=2, hashes=shared), now=0.0)
    first = clock.step()
    assert first.scheduled_tokens == 330
    assert first.prefix_cache_queries == 330 and first.prefix_cache_hits == 0
    clock.run_until_idle()
    engine.add_request(request("b", prompt=330, output=2, hashes=shared), now=clock.now)
    second = clock.step()
    assert second.scheduled_tokens == 330 - 320
    assert second.prefix_cache_hits == 320
    assert second.duration_s < first.duration_s


def test_prefix_cache_never_skips_the_whole_prompt() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    hashes = (1, 2)
    engine.add_request(request("a", prompt=32, output=1, hashes=hashes), now=0.0)
    clock.run_until_idle()
    engine.add_request(request("b", prompt=32, output=1, hashes=hashes), now=clock.now)
    outcome = clock.step()
    assert outcome.scheduled_tokens == 16  # the last block is recomputed to sample the first token


def test_without_prefix_caching_equal_prompts_prefill_fully() -> None:
    engine = make_engine(enable_prefix_caching=False)
    clock = VirtualClock(engine)
    for name in ("a", "b"):
        engine.add_request(request(name, prompt=330, output=1, hashes=tuple(range(20))), now=clock.now)
        assert clock.step().scheduled_tokens == 330


def test_cached_blocks_count_as_free_and_are_evicted_when_needed() -> None:
    engine = make_engine(num_gpu_blocks=25, enable_prefix_caching=True, max_model_len=400)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=320, output=1, hashes=tuple(range(20))), now=0.0)
    clock.run_until_idle()
    assert engine.kv.usage == 0.0
    engine.add_request(request("b", prompt=320, output=1, hashes=tuple(range(100, 120))), now=clock.now)
    assert clock.step().scheduled_tokens == 320
    engine.add_request(request("c", prompt=320, output=1, hashes=tuple(range(20))), now=clock.now)
    assert clock.step().prefix_cache_hits == 5 * 16  # b evicted the tail of a's prefix, not its head


def test_abort_frees_blocks_and_forgets_the_request() -> None:
    engine = make_engine()
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=100, output=50), now=0.0)
    engine.add_request(request("b", prompt=100, output=50), now=0.0)
    clock.step()
    assert engine.abort("a")
    assert engine.kv.used_blocks == engine.kv.blocks_for(101)
    assert not engine.abort("a")
    clock.run_until_idle()
    assert set(clock.finished()) == {"b"}


def test_leaked_blocks_shrink_capacity() -> None:
    engine = make_engine(num_gpu_blocks=100, max_model_len=400)
    assert engine.leak_blocks(30) == 30
    assert engine.kv.usage == pytest.approx(0.3)
    assert engine.leak_blocks(500) == 70
    engine.add_request(request("a", prompt=10, output=1), now=0.0)
    outcome = engine.step(0.0)
    assert [f.reason for f in outcome.finished] == ["error"]
    assert not engine.has_work


def test_max_model_len_must_fit_the_cache() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(num_gpu_blocks=10, block_size=16, max_model_len=1000)
