"""The benchmarks' request mix, client-shaped request bodies and seeded arrival processes. Pure, no I/O.

Four request classes share one fleet (shares, prompt lengths in tokens, the client's ``max_tokens``, TTFT
objective):

==============  =====  ===========================  ==============================  =========  ======
class           share  prompt                       client max_tokens               streaming  SLO
==============  =====  ===========================  ==============================  =========  ======
chat            45 %   lognormal, median 400, ≤ 2k  1024 (60 %), 4096 (25 %), none  half       1 s
code            35 %   uniform 800–2,000            128 (80 %), 256                 no         1 s
summarisation   12 %   uniform 8k–16k               1024 (50 %), none               no         5 s
long_stream      8 %   uniform 500–1,500            4096 (70 %), none               yes        5 s
==============  =====  ===========================  ==============================  =========  ======

Clients behave as real ones do: ``max_tokens`` is a generous cap (or absent) and the model stops where it
stops (the simulated worker ends each answer at a seeded natural length), so a router cannot read the
output length off the request. Prompt text is English-like prose (about 4.7 characters per simulator token)
or code (about 3.4), not the flat 4.0 of a character-count estimate, so prompt sizes are known to a router
only as well as its estimate is good. Code goes to the code model through ``/v1/completions``; the rest to
the chat model through ``/v1/chat/completions``. Every request is sent with ``stream: true`` whatever its
nominal mode, because a client cannot observe the first token of a non-streamed answer;
``RequestSpec.nominal_stream`` keeps the class's real mode for the report.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

from simworker.tokens import tokenize

ModelRole = Literal["chat", "code"]
TextStyle = Literal["prose", "code"]
Sampler = Callable[[random.Random], int]
CapSampler = Callable[[random.Random], int | None]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_PROSE = ("the a of to and in is that for it with as on be by this are we from or at an not which have can but "
          "if will data model request worker throughput latency configuration performance, scheduling. cluster "
          "memory (cache) tokens; quarterly revenue grew 12% year-over-year, while operating costs declined. "
          "customers reported improvements in reliability and responsiveness. However, the migration introduced "
          "regressions that engineers investigated thoroughly. Please summarise: what changed? Section 4.2 "
          "describes infrastructure, deployment, monitoring & alerting.").split()
_CODE = ("def return self if else for in range ( ) : = == + - * [ ] { } . , import from class None True False x i "
         "n value result items len append dict list str int -> # print get_value(key) os.path.join(root, name) "
         "assert isinstance(obj, Mapping) self._cache[key] = value").split()


@dataclass(frozen=True)
class Vocabulary:
    """Words with their token counts under the simulated worker's tokenizer (words never share a token)."""

    words: tuple[str, ...]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, words: Sequence[str]) -> Vocabulary:
        return cls(tuple(words), tuple(len(tokenize(word)) for word in words))

    def text(self, tokens: int, rng: random.Random, lead: str | None = None) -> str:
        """Space-separated words that the worker counts as exactly ``tokens`` tokens; ``lead`` (one token)
        first, which makes a text distinct from the first block on."""
        if tokens < 1:
            raise ValueError("a text needs at least one token")
        words = [lead] if lead is not None else []
        left = tokens - len(words)
        while left > 0:
            index = rng.randrange(len(self.words))
            if self.tokens[index] <= left:
                words.append(self.words[index])
                left -= self.tokens[index]
        return " ".join(words)


VOCABULARIES: dict[TextStyle, Vocabulary] = {"prose": Vocabulary.of(_PROSE), "code": Vocabulary.of(_CODE)}


def text(tokens: int, seed: int, style: TextStyle = "prose", unique: bool = True) -> str:
    """Seeded text of exactly ``tokens`` worker tokens; ``unique`` starts it with a word made from the seed."""
    lead = f"r{seed % 10_000_000}" if unique else None
    return VOCABULARIES[style].text(tokens, random.Random(seed), lead)


def chat_message_tokens(role: str, content_tokens: int) -> int:
    """Tokens of one rendered chat message: ``<|start|>role<|sep|>content<|end|>``."""
    return 3 + len(tokenize(role)) + content_tokens


ASSISTANT_PRIMING_TOKENS = 4
"""``<|start|>assistant<|sep|>`` closes every rendered chat prompt."""


def _lognormal(median: float, sigma: float, low: int, high: int) -> Sampler:
    def draw(rng: random.Random) -> int:
        return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))
    return draw


def _uniform(low: int, high: int) -> Sampler:
    def draw(rng: random.Random) -> int:
        return rng.randint(low, high)
    return draw


def client_cap(*choices: tuple[int | None, float]) -> CapSampler:
    """A client's ``max_tokens``: one of ``choices`` (cap or None for absent, weight)."""
    caps = [cap for cap, _ in choices]
    weights = [weight for _, weight in choices]

    def draw(rng: random.Random) -> int | None:
        return rng.choices(caps, weights)[0]
    return draw


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    share: float
    role: ModelRole
    path: str
    prompt_tokens: Sampler
    max_tokens: CapSampler
    prompt_range: tuple[int, int]
    streaming_share: float
    """Share of the class that is nominally streamed (the report's mode; the wire always streams)."""
    slo_ttft_s: float
    style: TextStyle = "prose"


MIX: tuple[WorkloadClass, ...] = (
    WorkloadClass("chat", 0.45, "chat", CHAT_PATH, _lognormal(400, 0.7, 16, 2000),
                  client_cap((1024, 0.6), (4096, 0.25), (None, 0.15)), (16, 2000), 0.5, 1.0),
    WorkloadClass("code", 0.35, "code", COMPLETIONS_PATH, _uniform(800, 2000), client_cap((128, 0.8), (256, 0.2)),
                  (800, 2000), 0.0, 1.0, "code"),
    WorkloadClass("summarisation", 0.12, "chat", CHAT_PATH, _uniform(8000, 16000),
                  client_cap((1024, 0.5), (None, 0.5)), (8000, 16000), 0.0, 5.0),
    WorkloadClass("long_stream", 0.08, "chat", CHAT_PATH, _uniform(500, 1500), client_cap((4096, 0.7), (None, 0.3)),
                  (500, 1500), 1.0, 5.0),
)
CLASSES = {c.name: c for c in MIX}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace; ``arrival_s`` is in model (simulated GPU) seconds from the trace start.

    ``prompt_tokens`` is what the worker counts (template included); ``max_tokens`` is the client's cap
    (None: not sent)."""

    index: int
    arrival_s: float
    workload: str
    role: ModelRole
    path: str
    prompt_tokens: int
    max_tokens: int | None
    nominal_stream: bool
    slo_ttft_s: float
    text_seed: int
    style: TextStyle = "prose"


def _pick_class(rng: random.Random, mix: Sequence[WorkloadClass]) -> WorkloadClass:
    draw = rng.random() * sum(c.share for c in mix)
    for workload in mix:
        draw -= workload.share
        if draw < 0:
            return workload
    return mix[-1]


def draw_request(rng: random.Random, index: int, arrival_s: float,
                 mix: Sequence[WorkloadClass] = MIX) -> RequestSpec:
    """One request of the mix (class, lengths, cap, nominal mode) from ``rng``."""
    workload = _pick_class(rng, mix)
    return RequestSpec(
        index=index, arrival_s=arrival_s, workload=workload.name, role=workload.role, path=workload.path,
        prompt_tokens=workload.prompt_tokens(rng), max_tokens=workload.max_tokens(rng),
        nominal_stream=rng.random() < workload.streaming_share, slo_ttft_s=workload.slo_ttft_s,
        text_seed=rng.getrandbits(32), style=workload.style,
    )


@dataclass(frozen=True)
class Arrivals:
    """An arrival process with mean rate ``rate_per_s``: Poisson, or on/off bursts (a Markov-modulated
    Poisson process with fixed phases: ``on_share`` of each ``period_s`` at ``on_factor`` × the mean rate,
    the rest at the rate that keeps the mean)."""

    rate_per_s: float
    bursty: bool = False
    period_s: float = 10.0
    on_share: float = 0.4
    on_factor: float = 2.0

    def rate_at(self, t: float) -> tuple[float, float]:
        """(rate, end of the phase that holds ``t``)."""
        if not self.bursty:
            return self.rate_per_s, math.inf
        start = math.floor(t / self.period_s) * self.period_s
        on_end = start + self.on_share * self.period_s
        if t < on_end:
            return self.rate_per_s * self.on_factor, on_end
        off_factor = (1 - self.on_share * self.on_factor) / (1 - self.on_share)
        return self.rate_per_s * off_factor, start + self.period_s

    def times(self, duration_s: float, rng: random.Random) -> list[float]:
        """Arrival times in [0, duration_s); memorylessness lets a gap that crosses a phase end restart there."""
        if self.rate_per_s <= 0 or duration_s <= 0:
            raise ValueError("rate and duration must be positive")
        if self.bursty and not 0 < self.on_share * self.on_factor < 1:
            raise ValueError("on_share × on_factor must be in (0, 1)")
        times: list[float] = []
        t = 0.0
        while True:
            rate, phase_end = self.rate_at(t)
            step = rng.expovariate(rate)
            if t + step >= phase_end:
                t = phase_end
                continue
            t += step
            if t >= duration_s:
                return times
            times.append(t)


def poisson_trace(rate_per_s: float, duration_s: float, seed: int,
                  mix: Sequence[WorkloadClass] = MIX, bursty: bool = False) -> list[RequestSpec]:
    """Open-loop arrivals of the mix at ``rate_per_s`` over ``duration_s`` (model seconds); same seed, same trace."""
    rng = random.Random(seed)
    times = Arrivals(rate_per_s, bursty).times(duration_s, rng)
    return [draw_request(rng, index, arrival, mix) for index, arrival in enumerate(times)]


def prompt_text(tokens: int, seed: int, style: TextStyle = "prose") -> str:
    """A distinct prompt of exactly ``tokens`` worker tokens."""
    return text(tokens, seed, style)


def completion_fields(max_tokens: int | None) -> dict[str, object]:
    """What every benchmark client sends besides the prompt: streamed, usage at the end, its cap if any."""
    fields: dict[str, object] = {"stream": True, "stream_options": {"include_usage": True}}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return fields


def request_body(spec: RequestSpec, model: str) -> bytes:
    """The JSON body sent for ``spec``: one user message (chat) or a prompt (completions)."""
    body: dict[str, object] = {"model": model, **completion_fields(spec.max_tokens)}
    if spec.path == CHAT_PATH:
        content_tokens = spec.prompt_tokens - chat_message_tokens("user", 0) - ASSISTANT_PRIMING_TOKENS
        body["messages"] = [{"role": "user", "content": prompt_text(max(1, content_tokens), spec.text_seed,
                                                                       spec.style)}]
    else:
        body["prompt"] = prompt_text(spec.prompt_tokens, spec.text_seed, spec.style)
    return orjson.dumps(body)
