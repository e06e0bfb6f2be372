"""Where the simulated model stops by itself: a natural output length per request, drawn by task kind.

A real model ends its answer with an EOS token; ``max_tokens`` only caps it. The simulator cannot read
a prompt, so it names a task kind from what it can see, first match wins:

=============  ======================================  ===================================  ==========
kind           rule                                    natural length (tokens, EOS incl.)   range
=============  ======================================  ===================================  ==========
code           ``/v1/completions``                     lognormal, median 13, sigma 1.2      1-1,024
long_context   chat, prompt >= 4,096 tokens            lognormal, median 300, sigma 0.6     16-2,048
conversation   any other chat                          90 %: lognormal, median 129, σ 0.9   1-4,096
                                                       10 %: lognormal, median 1,000, σ 0.5
=============  ======================================  ===================================  ==========

Why these: the legacy completions endpoint now mostly serves code completion (fill-in-the-middle, the
next lines), and Azure's public LLM inference trace of 2023 (Splitwise, Patel et al., ISCA 2024) reports
a median of about 13 output tokens for its coding service and about 129 for its conversation service,
both with long tails (sigma). The conversation tail is a 10 % share of long-form answers (essays, whole
programs) so that the mean, about 280 tokens, is near ShareGPT's mean answer of about 340 tokens (the
vLLM paper, Kwon et al., SOSP 2023). A chat prompt of 4k tokens or more is a document to summarise or to
answer questions about: a few paragraphs, like the 200-300-word abstracts of the arXiv and PubMed
summarisation sets (Cohan et al., NAACL 2018). Medians and sigmas are these published shapes, rounded;
the ranges only cut off the lognormal's far tails.

What is deliberately not a signal: ``stream`` (a model's answer does not depend on its transport, and
benchmark clients stream everything to time the first token) and ``max_tokens`` (the model never sees
it; reading it would tell a router, which sees it too, every request's length).

The draw is seeded by the request alone: a stable hash of the model name, the prompt's tokens and the
request's ``seed`` field when given. The same request gets the same length on whichever worker serves it,
as a fair comparison of routers needs; a different ``seed`` gives a different answer length, as it gives
a different sample on vLLM. Nothing here uses a worker's own randomness.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

LONG_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class LengthMode:
    weight: float
    median: float
    sigma: float


@dataclass(frozen=True)
class TaskKind:
    name: str
    modes: tuple[LengthMode, ...]
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        pick = rng.random() * sum(mode.weight for mode in self.modes)
        mode = self.modes[-1]
        for candidate in self.modes:
            pick -= candidate.weight
            if pick < 0:
                mode = candidate
                break
        length = round(rng.lognormvariate(math.log(mode.median), mode.sigma))
        return max(self.low, min(self.high, length))


CODE = TaskKind("code", (LengthMode(1.0, 13, 1.2),), 1, 1024)
LONG_CONTEXT = TaskKind("long_context", (LengthMode(1.0, 300, 0.6),), 16, 2048)
CONVERSATION = TaskKind("conversation", (LengthMode(0.9, 129, 0.9), LengthMode(0.1, 1000, 0.5)), 1, 4096)


def task_kind(chat: bool, prompt_tokens: int) -> TaskKind:
    """The module's rule: the endpoint first, then the prompt's length."""
    if not chat:
        return CODE
    return LONG_CONTEXT if prompt_tokens >= LONG_PROMPT_TOKENS else CONVERSATION


def request_seed(model: str, prompt_tokens: Sequence[str], seed: int | None) -> int:
    """A seed that depends on the request only (the same in every process, unlike ``hash()``)."""
    material = "\x1e".join((model, "" if seed is None else str(seed), "\x1f".join(prompt_tokens)))
    return int.from_bytes(hashlib.blake2b(material.encode(), digest_size=8).digest(), "big")


def natural_output_length(kind: TaskKind, seed: int) -> int:
    """Output tokens up to and including the EOS the model would sample for this request."""
    return kind.draw(random.Random(seed))
