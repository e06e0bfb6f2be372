"""Token estimates, expected output, task classes and affinity keys: what a request is expected to cost."""

from __future__ import annotations

import ast
import os
import statistics
from pathlib import Path

import orjson
import pytest

from extproc.request import RequestFacts, RequestHead
from extproc.scheduling.estimate import (
    RequestProfiler,
    build_profiler,
    char_counter,
    classify,
    prefix_keys,
    prompt_tokens_lower_bound,
    tokenizer_counter,
)
from poolgate.kernel.config import ConfigError, SchedulingSettings, TaskClassRules
from tests.unit.test_extproc_request import parse_request

CHAT = RequestHead("POST", "/v1/chat/completions", None)
COMPLETIONS = RequestHead("POST", "/v1/completions", None)
REPO = Path(__file__).resolve().parents[2]
REFERENCE_TOKENIZER_ENV = "POOLGATE_TEST_TOKENIZER"
"""A local directory (or file) with a ``tokenizer.json`` to measure the fast estimate against, when set."""


def parsed(head: RequestHead, body: dict[str, object]) -> RequestFacts:
    facts = parse_request(head, orjson.dumps(body))
    assert isinstance(facts, RequestFacts)
    return facts


def chat(*contents: str, **extra: object) -> RequestFacts:
    return parsed(CHAT, {"model": "m", "messages": [{"role": "user", "content": c} for c in contents], **extra})


@pytest.mark.parametrize(("facts", "expected"), [
    (chat("x" * 400), 100 + 4 + 4),  # 400 chars / 4, one message, reply priming
    (chat("x" * 401), 101 + 4 + 4),  # rounded up
    (chat("ab", "cd", "ef"), 2 + 3 * 4 + 4),  # characters are counted over the whole prompt
    (parsed(COMPLETIONS, {"model": "m", "prompt": "y" * 80}), 20),  # no template on completions
    (parsed(COMPLETIONS, {"model": "m", "prompt": [5] * 33}), 33),  # token ids are exact
])
def test_prompt_estimate(facts: RequestFacts, expected: int) -> None:
    assert RequestProfiler(SchedulingSettings()).profile(facts).prompt_tokens == expected


@pytest.mark.parametrize(("chars_per_token", "chars", "expected"), [(4.0, 10, 3), (2.5, 10, 4), (8.0, 0, 0)])
def test_char_counter(chars_per_token: float, chars: int, expected: int) -> None:
    facts = RequestFacts("/v1/completions", "POST", "m", prompt_chars=chars)
    assert char_counter(chars_per_token)(facts) == expected


def test_lower_bound_never_exceeds_the_estimate() -> None:
    for text in ("", "a", "word " * 100, "x" * 10_000):
        facts = chat(text)
        request = RequestProfiler(SchedulingSettings()).profile(facts)
        assert prompt_tokens_lower_bound(facts) == request.min_prompt_tokens <= request.prompt_tokens


@pytest.mark.parametrize(("max_tokens", "default", "expected"), [(None, 256, 256), (None, 40, 40), (7, 256, 7)])
def test_expected_output(max_tokens: int | None, default: int, expected: int) -> None:
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    request = RequestProfiler(SchedulingSettings(default_output_tokens=default)).profile(chat("hi", **extra))
    assert request.output_tokens == expected


RULES = TaskClassRules(long_context_min_tokens=1000, streaming_min_output_tokens=500, code_models=("coder",))


@pytest.mark.parametrize(("prompt", "output", "stream", "model", "expected"), [
    (10, 100, False, "m", "short_chat"),
    (10, 500, True, "m", "streaming"),
    (10, 499, True, "m", "short_chat"),  # streamed but short: a chat like any other
    (10, 500, False, "m", "short_chat"),  # long but not streamed
    (1000, 10, False, "m", "long_context"),
    (5000, 600, True, "m", "streaming"),  # first rule wins
    (10, 10, False, "coder", "code_completion"),
    (2000, 10, False, "coder", "long_context"),
])
def test_task_class_rules(prompt: int, output: int, stream: bool, model: str, expected: str) -> None:
    facts = RequestFacts("/v1/chat/completions", "POST", model, stream=stream)
    assert classify(prompt, output, facts, RULES) == expected


def test_prefix_keys_share_the_common_leading_chunks() -> None:
    system = "S" * 512
    first = prefix_keys(chat(system, "question one " * 30), 256, 32)
    second = prefix_keys(chat(system, "another question " * 30), 256, 32)
    assert len(first) == (512 + 1 + 390) // 256
    shared = set(first) & set(second)
    assert len(shared) == 2  # the two chunks of the system prompt
    assert first[-2:] == second[-2:]  # shortest prefixes last
    assert prefix_keys(chat("short"), 256, 32) == ()
    assert len(prefix_keys(chat("z" * 100_000), 256, 8)) == 8  # bounded work


def test_prefix_keys_lead_with_the_session_and_depend_on_the_model() -> None:
    facts = chat("q" * 300, user="alice")
    keys = prefix_keys(facts, 256, 32)
    assert keys[0] == ("session", "m", "alice") and len(keys) == 2
    other_model = parsed(CHAT, {"model": "n", "messages": [{"role": "user", "content": "q" * 300}]})
    assert prefix_keys(other_model, 256, 32)[-1] != keys[-1]


def test_no_prefix_keys_when_affinity_is_off() -> None:
    facts = chat("q" * 3000, user="alice")
    assert build_profiler(SchedulingSettings(weights={"inflight": 1})).profile(facts).affinity_keys == ()
    assert build_profiler(SchedulingSettings(affinity_max_entries=0)).profile(facts).affinity_keys == ()
    assert build_profiler(SchedulingSettings()).profile(facts).affinity_keys


def test_bad_tokenizer_path_fails_at_start_with_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"scheduling\.tokenizer_path"):
        build_profiler(SchedulingSettings(tokenizer_path=str(tmp_path / "missing")))
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match=r"scheduling\.tokenizer_path"):
        tokenizer_counter(str(tmp_path))


def _samples() -> dict[str, list[str]]:
    """Prose (docstrings, README paragraphs) and code (source files) from this repository: real text, offline."""
    prose: list[str] = []
    code: list[str] = []
    for path in sorted([*REPO.glob("poolgate/*.py"), *REPO.glob("extproc/**/*.py")]):
        source = path.read_text()
        if len(source) > 500:
            code.append(source[:3000])
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    prose.append(doc)
    prose += [p for p in (REPO / "README.md").read_text().split("\n\n") if len(p) > 200]
    return {"prose": prose, "code": code}


def _median_error(reference: object, kind: str) -> float:
    count = char_counter(SchedulingSettings().chars_per_token)
    errors = []
    for text in _samples()[kind]:
        facts = RequestFacts("/v1/completions", "POST", "m", prompt_chars=len(text), prompt_parts=(text,))
        truth = reference(text)  # type: ignore[operator]
        errors.append(abs(count(facts) - truth) / truth)
    return statistics.median(errors)


@pytest.mark.parametrize(("kind", "bound"), [("prose", 0.12), ("code", 0.10)])
def test_error_against_the_simulated_workers_tokenizer(kind: str, bound: float) -> None:
    tokens = pytest.importorskip("simworker.tokens")
    assert _median_error(lambda text: len(tokens.tokenize(text)), kind) <= bound


@pytest.mark.parametrize(("kind", "bound"), [("prose", 0.12), ("code", 0.10)])
def test_error_against_a_real_tokenizer(kind: str, bound: float) -> None:
    path = os.environ.get(REFERENCE_TOKENIZER_ENV)
    if not path:
        pytest.skip(f"set {REFERENCE_TOKENIZER_ENV} to a local tokenizer.json to measure against it")
    tokenizers = pytest.importorskip("tokenizers")
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    assert _median_error(lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids), kind) <= bound


def test_real_tokenizer_counter_counts_every_part() -> None:
    path = os.environ.get(REFERENCE_TOKENIZER_ENV)
    if not path:
        pytest.skip(f"set {REFERENCE_TOKENIZER_ENV} to a local tokenizer.json")
    pytest.importorskip("tokenizers")
    count = tokenizer_counter(path)
    one = count(chat("hello world"))
    assert one > 0 and count(chat("hello world", "hello world")) == 2 * one
