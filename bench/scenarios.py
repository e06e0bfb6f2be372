"""Named, seeded traffic scenarios: the same trace (requests and bodies) for every router. Pure, no I/O.

- ``mix``: the request mix of ``workload`` (chat, code completion, long summarisation, long streams).
- ``sessions``: multi-turn chats. Each session keeps one of a few shared system prompts (skewed: the first
  is the most used); turn k sends the whole conversation so far, so its prompt is turn k−1's prompt plus
  the answer plus a new user message. The answer in the history is a seeded stand-in of a typical answer's
  length (the trace is fixed before any router runs, so it cannot hold the worker's real answer: the
  worker's cache of its own generated tokens is not reused here, the shared prompt part is).
- ``shared-docs``: many tenants, each asking short questions about its own long document (4–8k tokens);
  document popularity is Zipf-skewed (a few hot documents, a long tail).

Each scenario runs with Poisson or on/off (bursty) arrivals at a mean rate in requests per model second.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from bench.workload import (
    ASSISTANT_PRIMING_TOKENS,
    CHAT_PATH,
    MIX,
    Arrivals,
    ModelRole,
    RequestSpec,
    chat_message_tokens,
    client_cap,
    completion_fields,
    draw_request,
    request_body,
    text,
)


@dataclass(frozen=True)
class Trace:
    requests: tuple[RequestSpec, ...]
    bodies: tuple[bytes, ...]


@dataclass(frozen=True)
class ClassInfo:
    name: str
    slo_ttft_s: float


TraceBuilder = Callable[[Arrivals, float, int, Mapping[ModelRole, str]], Trace]


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    roles: tuple[ModelRole, ...]
    classes: tuple[ClassInfo, ...]
    build: TraceBuilder
    """``build(arrivals, duration_s, seed, model_of_role)``."""

    def trace(self, rate_per_s: float, duration_s: float, seed: int, models: Mapping[ModelRole, str],
              bursty: bool = False) -> Trace:
        return self.build(Arrivals(rate_per_s, bursty), duration_s, seed, models)


def _mix(arrivals: Arrivals, duration_s: float, seed: int, models: Mapping[ModelRole, str]) -> Trace:
    rng = random.Random(seed)
    requests = tuple(draw_request(rng, index, t) for index, t in enumerate(arrivals.times(duration_s, rng)))
    return Trace(requests, tuple(request_body(r, models[r.role]) for r in requests))


def _chat_body(model: str, messages: list[dict[str, str]], max_tokens: int | None) -> bytes:
    return orjson.dumps({"model": model, "messages": messages, **completion_fields(max_tokens)})


def _chat_prompt_tokens(parts: list[tuple[str, int]]) -> int:
    return sum(chat_message_tokens(role, tokens) for role, tokens in parts) + ASSISTANT_PRIMING_TOKENS


SESSION_SLO_S = 2.0
SYSTEM_PROMPT_TOKENS = (1500, 1000, 600, 300)
SYSTEM_PROMPT_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
SESSION_CAP = client_cap((1024, 0.7), (None, 0.3))
SESSION_LEAD_S = 60.0
"""Longer than a whole session (at most 6 turns, ~8 s apart on average)."""


def _sessions(arrivals: Arrivals, duration_s: float, seed: int, models: Mapping[ModelRole, str]) -> Trace:
    """Sessions start at ``rate / mean turns``, so the request rate is ``arrivals.rate_per_s``; they start from
    ``SESSION_LEAD_S`` before the trace, so the trace opens mid-conversation (only turns inside it are sent,
    with their whole history) and the turn rate is steady from its first second."""
    rng = random.Random(seed)
    mean_turns = 4.0
    starts = [t - SESSION_LEAD_S for t in Arrivals(
        arrivals.rate_per_s / mean_turns, arrivals.bursty, arrivals.period_s, arrivals.on_share,
        arrivals.on_factor).times(duration_s + SESSION_LEAD_S, rng)]
    systems = [text(tokens, seed * 31 + i) for i, tokens in enumerate(SYSTEM_PROMPT_TOKENS)]
    pending: list[tuple[float, list[tuple[str, int]], list[dict[str, str]], int | None]] = []
    for start in starts:
        choice = rng.choices(range(len(systems)), SYSTEM_PROMPT_WEIGHTS)[0]
        messages = [{"role": "system", "content": systems[choice]}]
        parts = [("system", SYSTEM_PROMPT_TOKENS[choice])]
        t = start
        for _ in range(rng.randint(2, 6)):
            user_tokens = max(4, round(rng.lognormvariate(3.9, 0.6)))  # median ~50
            messages = [*messages, {"role": "user", "content": text(user_tokens, rng.getrandbits(32))}]
            parts = [*parts, ("user", user_tokens)]
            if t >= duration_s:
                break
            cap = SESSION_CAP(rng)
            if t >= 0:
                pending.append((t, parts, messages, cap))
            answer_tokens = max(8, min(600, round(rng.lognormvariate(5.0, 0.6))))  # median ~150
            messages = [*messages, {"role": "assistant", "content": text(answer_tokens, rng.getrandbits(32))}]
            parts = [*parts, ("assistant", answer_tokens)]
            t += 2.0 + rng.expovariate(1 / 6.0)  # reading the answer, then typing: ~8 s on average
    pending.sort(key=lambda item: item[0])
    requests = tuple(
        RequestSpec(index=i, arrival_s=t, workload="session_turn", role="chat", path=CHAT_PATH,
                    prompt_tokens=_chat_prompt_tokens(parts), max_tokens=cap, nominal_stream=True,
                    slo_ttft_s=SESSION_SLO_S, text_seed=0)
        for i, (t, parts, _, cap) in enumerate(pending))
    bodies = tuple(_chat_body(models["chat"], messages, cap) for _, _, messages, cap in pending)
    return Trace(requests, bodies)


DOC_SLO_S = 3.0
DOCUMENTS = 24
DOC_TOKENS = (4000, 8000)
ZIPF_S = 1.1
DOC_CAP = client_cap((512, 0.6), (None, 0.4))


def _shared_docs(arrivals: Arrivals, duration_s: float, seed: int, models: Mapping[ModelRole, str]) -> Trace:
    rng = random.Random(seed)
    doc_rng = random.Random(seed * 7919)
    documents = [(tokens, text(tokens, seed * 1009 + d))
                 for d, tokens in enumerate(doc_rng.randint(*DOC_TOKENS) for _ in range(DOCUMENTS))]
    popularity = [1 / (rank + 1) ** ZIPF_S for rank in range(DOCUMENTS)]
    requests: list[RequestSpec] = []
    bodies: list[bytes] = []
    for index, t in enumerate(arrivals.times(duration_s, rng)):
        doc = rng.choices(range(DOCUMENTS), popularity)[0]
        doc_tokens, document = documents[doc]
        question_tokens = rng.randint(15, 60)
        cap = DOC_CAP(rng)
        messages = [{"role": "system", "content": document},
                    {"role": "user", "content": text(question_tokens, rng.getrandbits(32))}]
        requests.append(RequestSpec(
            index=index, arrival_s=t, workload="doc_question", role="chat", path=CHAT_PATH,
            prompt_tokens=_chat_prompt_tokens([("system", doc_tokens), ("user", question_tokens)]),
            max_tokens=cap, nominal_stream=rng.random() < 0.5, slo_ttft_s=DOC_SLO_S, text_seed=doc))
        bodies.append(_chat_body(models["chat"], messages, cap))
    return Trace(tuple(requests), tuple(bodies))


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("mix", "chat, code completion, long summarisation and long streams on two models", ("chat", "code"),
             tuple(ClassInfo(c.name, c.slo_ttft_s) for c in MIX), _mix),
    Scenario("sessions", "multi-turn chats over a few shared system prompts", ("chat",),
             (ClassInfo("session_turn", SESSION_SLO_S),), _sessions),
    Scenario("shared-docs", f"short questions about {DOCUMENTS} long documents (4–8k tokens), Zipf-popular",
             ("chat",), (ClassInfo("doc_question", DOC_SLO_S),), _shared_docs),
)}
