"""The scheduling benchmark's request mix and its seeded, open-loop (Poisson) traces. Pure, no I/O.

Four request classes share one fleet (shares, lengths in tokens, TTFT objective):

==============  =====  ===========================  ==================  =========  ======
class           share  prompt                       output              streaming  SLO
==============  =====  ===========================  ==================  =========  ======
chat            45 %   lognormal, median 400, ≤ 2k  lognormal, med 150  half       1 s
                                                    ≤ 512
code            35 %   uniform 800–2,000            uniform 16–64       no         1 s
summarisation   12 %   uniform 8k–16k               uniform 256–512     no         5 s
long_stream      8 %   uniform 500–1,500            uniform 1k–2k       yes        5 s
==============  =====  ===========================  ==================  =========  ======

Code goes to the code model through ``/v1/completions``; the rest to the chat model through
``/v1/chat/completions``. Prompt text is built so that the simulated worker's tokenizer (one token per
word of at most 8 characters; chat adds a fixed template) counts exactly the intended prompt tokens,
and the output length is forced with ``max_tokens`` + ``ignore_eos``. Every request is sent with
``stream: true`` whatever its nominal mode, because a client cannot observe the first token of a
non-streamed answer; ``RequestSpec.nominal_stream`` keeps the class's real mode for the report.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

ModelRole = Literal["chat", "code"]
Sampler = Callable[[random.Random], int]

CHAT_TEMPLATE_TOKENS = 8
"""Tokens the worker's chat template adds to one user message: ``<|start|>user<|sep|>`` … ``<|end|>``
(4) plus the assistant priming ``<|start|>assistant<|sep|>`` (4)."""

WORDS = ("and", "the", "of", "data", "map", "node", "run", "to", "is", "set", "key", "load",
         "in", "we", "row", "page", "it", "token", "for", "bit", "queue", "on", "gpu", "kv",
         "time", "as", "pool", "by", "step", "be", "work", "at")
"""Filler vocabulary: every entry is one token for the simulator (≤ 8 word characters), 4.0 characters per
token on average with its space, as real tokenizers give for English prose (and as extproc's estimate assumes)."""


def _lognormal(median: float, sigma: float, low: int, high: int) -> Sampler:
    def draw(rng: random.Random) -> int:
        return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))
    return draw


def _uniform(low: int, high: int) -> Sampler:
    def draw(rng: random.Random) -> int:
        return rng.randint(low, high)
    return draw


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    share: float
    role: ModelRole
    path: str
    prompt_tokens: Sampler
    output_tokens: Sampler
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    streaming_share: float
    """Share of the class that is nominally streamed (the report's mode; the wire always streams)."""
    slo_ttft_s: float


CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

MIX: tuple[WorkloadClass, ...] = (
    WorkloadClass("chat", 0.45, "chat", CHAT_PATH, _lognormal(400, 0.7, 16, 2000), _lognormal(150, 0.7, 8, 512),
                  (16, 2000), (8, 512), 0.5, 1.0),
    WorkloadClass("code", 0.35, "code", COMPLETIONS_PATH, _uniform(800, 2000), _uniform(16, 64),
                  (800, 2000), (16, 64), 0.0, 1.0),
    WorkloadClass("summarisation", 0.12, "chat", CHAT_PATH, _uniform(8000, 16000), _uniform(256, 512),
                  (8000, 16000), (256, 512), 0.0, 5.0),
    WorkloadClass("long_stream", 0.08, "chat", CHAT_PATH, _uniform(500, 1500), _uniform(1000, 2000),
                  (500, 1500), (1000, 2000), 1.0, 5.0),
)
CLASSES = {c.name: c for c in MIX}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace; ``arrival_s`` is in model (simulated GPU) seconds from the trace start."""

    index: int
    arrival_s: float
    workload: str
    role: ModelRole
    path: str
    prompt_tokens: int
    output_tokens: int
    nominal_stream: bool
    slo_ttft_s: float
    text_seed: int


def _pick_class(rng: random.Random, mix: Sequence[WorkloadClass]) -> WorkloadClass:
    draw = rng.random() * sum(c.share for c in mix)
    for workload in mix:
        draw -= workload.share
        if draw < 0:
            return workload
    return mix[-1]


def draw_request(rng: random.Random, index: int, arrival_s: float,
                 mix: Sequence[WorkloadClass] = MIX) -> RequestSpec:
    """One request of the mix (class, lengths, nominal mode) from ``rng``."""
    workload = _pick_class(rng, mix)
    return RequestSpec(
        index=index, arrival_s=arrival_s, workload=workload.name, role=workload.role, path=workload.path,
        prompt_tokens=workload.prompt_tokens(rng), output_tokens=workload.output_tokens(rng),
        nominal_stream=rng.random() < workload.streaming_share, slo_ttft_s=workload.slo_ttft_s,
        text_seed=rng.getrandbits(32),
    )


def poisson_trace(rate_per_s: float, duration_s: float, seed: int,
                  mix: Sequence[WorkloadClass] = MIX) -> list[RequestSpec]:
    """Open-loop arrivals at ``rate_per_s`` over ``duration_s`` (model seconds); same seed, same trace."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed)
    trace: list[RequestSpec] = []
    arrival = rng.expovariate(rate_per_s)
    while arrival < duration_s:
        trace.append(draw_request(rng, len(trace), arrival, mix))
        arrival += rng.expovariate(rate_per_s)
    return trace


def prompt_text(tokens: int, seed: int) -> str:
    """``tokens`` words, each one simulator token; the first word makes prompts of a trace distinct."""
    if tokens < 1:
        raise ValueError("a prompt needs at least one token")
    rng = random.Random(seed)
    return " ".join([f"q{seed % 10_000_000}", *rng.choices(WORDS, k=tokens - 1)])


def request_body(spec: RequestSpec, model: str) -> bytes:
    """The JSON body sent for ``spec`` (always streamed; exact output length through ``ignore_eos``)."""
    body: dict[str, object] = {"model": model, "max_tokens": spec.output_tokens, "ignore_eos": True,
                               "stream": True}
    if spec.path == CHAT_PATH:
        content = prompt_text(max(1, spec.prompt_tokens - CHAT_TEMPLATE_TOKENS), spec.text_seed)
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = prompt_text(spec.prompt_tokens, spec.text_seed)
    return orjson.dumps(body)
