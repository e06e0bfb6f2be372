"""Token estimates for a request, made once before the pick: prompt tokens, expected output, task class.

Two prompt counts serve two purposes:

- ``min_prompt_tokens`` errs low on purpose: it is the only count allowed to refuse a request as too long,
  and a request must never be refused that the engine would have accepted. Tokenizers of current LLMs average
  3–5 characters per token on prose and code; 8 leaves room for long whitespace runs and rare words.
- ``prompt_tokens`` is the best guess, used for KV footprints and predicted prefill time:
  ``ceil(chars / chars_per_token)`` plus the chat template's overhead (``MESSAGE_OVERHEAD_TOKENS`` per message
  and ``REPLY_PRIMING_TOKENS`` once, as Llama-3-style templates spend on role headers), or the count of a
  real tokenizer when ``scheduling.tokenizer_path`` is set.

Once the prompt has been tokenised as the engine tokenises it (a pool's tokenizer with the model's chat
template, or the simulator's: ``kvcache.lookup``), ``exact_prompt`` puts that count in place of both.

Measured error of the fast estimate (``chars_per_token`` 4), median |estimate − reference| / reference per
text, on this repository's own docstrings and README paragraphs (prose, 40 texts) and source files (code, 31):
against the simulated worker's tokenizer 9 % on prose and 7 % on code; against a real 65k-vocabulary BPE
tokenizer (a ``tokenizer.json`` from a published package) 8 % on prose and 5 % on code. The aggregate ratio is
close to 4 characters per token for both. ``tests/unit/test_sched_estimate.py`` checks the first on every run
(bounds 12 % and 10 %) and the second when given a tokenizer file.

Expected output is ``max_tokens`` when the client set it, else ``scheduling.default_output_tokens``. The
usage a response reports is read only for quota reconciliation and the GenAI metrics (``usage``); it does not
feed back into the estimate, so there is no per-pool history.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from extproc.endpoints import ENDPOINTS
from extproc.endpoints.cost import apply_cost
from extproc.request import RequestFacts
from extproc.scheduling.plugins import PickRequest
from extproc.scheduling.registry import PLUGINS
from poolgate.kernel.config import ConfigError, SchedulingSettings, TaskClass, TaskClassRules

MAX_CHARS_PER_TOKEN = 8
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMING_TOKENS = 4


class PromptCounter(Protocol):
    """Counts the tokens of the prompt text (without template overhead)."""

    def __call__(self, facts: RequestFacts) -> int: ...


def prompt_tokens_lower_bound(facts: RequestFacts) -> int:
    return facts.prompt_token_ids + facts.prompt_chars // MAX_CHARS_PER_TOKEN


def char_counter(chars_per_token: float) -> PromptCounter:
    """The fast default: characters over an average characters-per-token ratio, rounded up."""

    def count(facts: RequestFacts) -> int:
        return facts.prompt_token_ids + int(-(-facts.prompt_chars // chars_per_token))

    return count


def tokenizer_counter(path: str) -> PromptCounter:
    """A real tokenizer from a local model directory (or a ``tokenizer.json`` file). Fails at start-up with
    the field to fix when the path or the ``tokenizers`` package is missing."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"scheduling.tokenizer_path: no tokenizer.json at {path!r}; point it at a local model "
                          "directory that has one, or remove it to use the character estimate")
    try:
        from tokenizers import Tokenizer  # optional dependency, only needed with tokenizer_path
    except ImportError as exc:
        raise ConfigError("scheduling.tokenizer_path needs the 'tokenizers' package: pip install tokenizers") \
            from exc
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own exception types for unreadable files
        raise ConfigError(f"scheduling.tokenizer_path: cannot load {file}: {exc}") from exc

    def count(facts: RequestFacts) -> int:
        if not facts.prompt_parts:
            return facts.prompt_token_ids
        encoded = tokenizer.encode_batch(list(facts.prompt_parts), add_special_tokens=False)
        return facts.prompt_token_ids + sum(len(e.ids) for e in encoded)

    return count


def classify(prompt_tokens: int, output_tokens: int, facts: RequestFacts, rules: TaskClassRules) -> TaskClass:
    """First matching rule wins (see ``TaskClassRules``)."""
    if facts.stream and output_tokens >= rules.streaming_min_output_tokens:
        return "streaming"
    if prompt_tokens >= rules.long_context_min_tokens:
        return "long_context"
    if facts.model in rules.code_models:
        return "code_completion"
    return "short_chat"


def _leading_text(parts: tuple[str, ...], limit: int) -> str:
    """The parts joined by ``\x1f``, only as far as the first ``limit`` characters need (a 1 MB prompt is
    not copied to hash its leading chunks)."""
    if len(parts) == 1:
        return parts[0]
    pieces: list[str] = []
    size = 0
    for index, part in enumerate(parts):
        if index:
            pieces.append("\x1f")
            size += 1
        pieces.append(part[:limit - size] if size < limit else "")
        size += len(part)
        if size >= limit:
            break
    return "".join(pieces)


def prefix_keys(facts: RequestFacts, chunk_chars: int, max_chunks: int) -> tuple[Hashable, ...]:
    """Chained hashes of the prompt's leading whole chunks, longest prefix first, after the session key.

    Equal keys mean equal leading text (up to hash collisions, which only cost a cache miss), so a request
    sharing a long prefix with an earlier one can follow it to the worker that has those KV blocks. The hash
    is CRC-32 continued chunk by chunk from the model's (the key of k chunks is the CRC of the model name and
    those k·chunk characters): the same in every extproc process, which share the map (Python's ``hash`` is
    salted per process).
    """
    keys: list[Hashable] = []
    if facts.session_id:
        keys.append(("session", facts.model, facts.session_id))
    text = _leading_text(facts.prompt_parts, chunk_chars * max_chunks)
    chunks = min(len(text) // chunk_chars, max_chunks)
    if chunks:
        chained: list[Hashable] = []
        running = zlib.crc32(facts.model.encode())
        for index in range(chunks):
            start = index * chunk_chars
            running = zlib.crc32(text[start:start + chunk_chars].encode("utf-8", "surrogatepass"), running)
            chained.append(running)
        chained.reverse()
        keys.extend(chained)
    return tuple(keys)


def exact_prompt(request: PickRequest, prompt_tokens: int, rules: TaskClassRules) -> PickRequest:
    """The request with the engine's own prompt count (its tokenizer and chat template: ``kvcache.lookup``) in
    place of the estimate: the exact count is both the best guess and the floor a context refusal may use.
    The task class follows it where the prompt decided it (``long_context`` or not); ``streaming`` was
    decided by the output and stays."""
    task_class = request.task_class
    if task_class != "streaming":
        if prompt_tokens >= rules.long_context_min_tokens:
            task_class = "long_context"
        elif task_class == "long_context":
            task_class = classify(prompt_tokens, 0, replace(request.facts, stream=False), rules)
    return replace(request, prompt_tokens=prompt_tokens, min_prompt_tokens=prompt_tokens, task_class=task_class)


class RequestProfiler:
    """Turns parsed facts into a ``PickRequest``: token estimates, task class and affinity keys."""

    def __init__(self, settings: SchedulingSettings, counter: PromptCounter | None = None,
                 with_prefix_keys: bool = True) -> None:
        self._settings = settings
        self._count = counter or char_counter(settings.chars_per_token)
        self._keys: Callable[[RequestFacts], tuple[Hashable, ...]] = (
            (lambda facts: prefix_keys(facts, settings.prefix_chunk_chars, settings.prefix_max_chunks))
            if with_prefix_keys and settings.affinity_max_entries else (lambda facts: ()))

    def profile(self, facts: RequestFacts) -> PickRequest:
        prompt = self._count(facts)
        endpoint = ENDPOINTS.get(facts.path)
        if endpoint is not None and endpoint.chat_template:
            prompt += facts.message_count * MESSAGE_OVERHEAD_TOKENS + REPLY_PRIMING_TOKENS
        output = facts.max_tokens or self._settings.default_output_tokens
        minimum = prompt_tokens_lower_bound(facts)
        if facts.cost is not None:  # endpoints beyond chat's rule (``endpoints.cost``)
            prompt, minimum, output = apply_cost(facts.cost, prompt, output, MAX_CHARS_PER_TOKEN)
        return PickRequest(
            facts=facts, prompt_tokens=prompt, min_prompt_tokens=minimum,
            output_tokens=output, task_class=classify(prompt, output, facts, self._settings.task_classes),
            affinity_keys=self._keys(facts),
        )


def build_profiler(settings: SchedulingSettings) -> RequestProfiler:
    """The profiler the settings ask for; raises ``ConfigError`` at start-up if the tokenizer cannot load."""
    counter = tokenizer_counter(settings.tokenizer_path) if settings.tokenizer_path else None
    # The latency scorer falls back on the affinity map where a worker's cache is not known from its events.
    weights = PLUGINS.weights(settings)
    affinity = weights.get("prefix_affinity", 0) > 0 or weights.get("latency", 0) > 0
    return RequestProfiler(settings, counter, with_prefix_keys=affinity)

