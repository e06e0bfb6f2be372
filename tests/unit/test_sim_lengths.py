"""Natural output lengths: seeded by the request alone, shaped by task kind, capped by max_tokens."""

from __future__ import annotations

import statistics

import pytest

from simworker import lengths, protocol
from simworker.protocol import WorkerApiError


def chat(content: str, **fields: object) -> protocol.GenerationRequest:
    return protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": content}], **fields})


def completion(prompt: str, **fields: object) -> protocol.GenerationRequest:
    return protocol.parse_completion({"model": "m", "prompt": prompt, **fields})


def natural(request: protocol.GenerationRequest, max_model_len: int = 32768) -> int:
    plan = protocol.plan_generation(request, max_model_len)
    assert plan.finish_reason == "stop"
    return plan.output_target


def words(count: int, salt: int) -> str:
    return f"q{salt} " + " ".join(f"w{(salt * 31 + i) % 89}" for i in range(count - 1))


def test_the_same_request_gets_the_same_length_wherever_it_runs() -> None:
    # plan_generation is all a worker uses: no worker-local state enters it, only the request and the model.
    first = protocol.plan_generation(chat("tell me about routers"), 8192, "m")
    again = protocol.plan_generation(chat("tell me about routers"), 16384, "m")
    assert first == again


def test_the_model_and_the_seed_field_change_the_draw() -> None:
    prompt = "tell me about routers"
    by_seed = {natural(chat(prompt, seed=seed)) for seed in range(20)}
    assert len(by_seed) > 10
    assert natural(chat(prompt, seed=7)) == natural(chat(prompt, seed=7))
    by_model = {protocol.plan_generation(chat(prompt), 8192, model).output_target for model in "abcdefgh"}
    assert len(by_model) > 4


@pytest.mark.parametrize(("build", "expected_median", "low", "high"), [
    (lambda i: completion(words(50, i)), 13, 1, 1024),
    (lambda i: chat(words(50, i)), 140, 1, 4096),
    (lambda i: chat(words(4100, i)), 300, 16, 2048),
])
def test_each_task_kind_has_its_documented_shape(build: object, expected_median: float, low: int,
                                                 high: int) -> None:
    drawn = [natural(build(i)) for i in range(600)]  # type: ignore[operator]
    assert 0.8 * expected_median <= statistics.median(drawn) <= 1.25 * expected_median
    assert low <= min(drawn) and max(drawn) <= high
    assert statistics.quantiles(drawn, n=10)[-1] > 2 * statistics.median(drawn)  # a long tail


def test_conversation_has_a_long_form_share() -> None:
    drawn = [natural(chat(words(30, i))) for i in range(1000)]
    long_form = sum(length >= 600 for length in drawn) / len(drawn)
    assert 0.06 <= long_form <= 0.16
    assert 220 <= statistics.mean(drawn) <= 360


def test_kind_rule() -> None:
    assert lengths.task_kind(chat=False, prompt_tokens=10_000) is lengths.CODE
    assert lengths.task_kind(chat=True, prompt_tokens=4095) is lengths.CONVERSATION
    assert lengths.task_kind(chat=True, prompt_tokens=4096) is lengths.LONG_CONTEXT


def test_max_tokens_is_only_a_cap() -> None:
    request = chat("write a poem")
    length = natural(request)
    assert length > 2
    at_cap = protocol.plan_generation(chat("write a poem", max_tokens=length), 8192)
    assert (at_cap.output_target, at_cap.finish_reason) == (length, "stop")  # EOS is the last allowed token
    below = protocol.plan_generation(chat("write a poem", max_tokens=length - 1), 8192)
    assert (below.output_target, below.finish_reason) == (length - 1, "length")
    generous = protocol.plan_generation(chat("write a poem", max_tokens=length * 10), 8192)
    assert (generous.output_target, generous.finish_reason) == (length, "stop")


def test_ignore_eos_runs_to_max_tokens() -> None:
    plan = protocol.plan_generation(chat("write a poem", max_tokens=3000, ignore_eos=True), 8192)
    assert (plan.output_target, plan.finish_reason) == (3000, "length")


def test_without_max_tokens_the_room_left_in_the_context_caps_it() -> None:
    document = words(4100, 3)
    length = natural(chat(document))
    prompt_len = len(chat(document).prompt_tokens)
    tight = protocol.plan_generation(chat(document), prompt_len + length - 1)
    assert (tight.output_target, tight.finish_reason) == (length - 1, "length")
    forced = protocol.plan_generation(chat(document, ignore_eos=True), prompt_len + 50)
    assert (forced.output_target, forced.finish_reason) == (50, "length")


def test_min_tokens_holds_the_eos_back() -> None:
    length = natural(chat("write a poem"))
    plan = protocol.plan_generation(chat("write a poem", min_tokens=length + 5, max_tokens=length + 100), 8192)
    assert (plan.output_target, plan.finish_reason) == (length + 5, "stop")


@pytest.mark.parametrize("seed", ["7", 1.5, True, 2**63])
def test_a_bad_seed_is_a_400(seed: object) -> None:
    with pytest.raises(WorkerApiError) as raised:
        chat("x", seed=seed)
    assert (raised.value.status, raised.value.param) == (400, "seed")
