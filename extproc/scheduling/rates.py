"""A worker's prefill rate and step time for predictions: the best its kind has shown.

    kind(w) = (model, KV capacity, GPU memory)          the same card serving the same model
    R(w)    = max over every record of kind(w) seen so far of ``prefill_tokens_per_s``
              (``default_prefill_tokens_per_s`` until one is known)
    S(w)    = min over every record of kind(w) seen so far of ``inter_token_s``
              (0 until one is known)

The agent's figure (``agent.rates``) is computed prompt tokens per second of the requests' prefill phase, and
a request's prefill phase lasts at least the one engine step that gives its first token, shared with every
decode and chunk in it. So the figure is the hardware's rate only while prompts are long and cold; when the
prompts are mostly cached (a few dozen new tokens each) it falls to tokens per step time. Measured in the
lab on three H100s serving questions about shared documents: 27,000 tokens/s on the cold start, 900 a
minute later, for the same engines. A prediction in seconds from that figure charges a cold 6,000-token
prompt 6.7 s instead of 0.22 s, and the prefill ledger (``extproc/prefill_ledger.py``) then keeps it queued
that long. The hardware does not slow down, so the best a kind has shown is kept: per worker, at any moment,
it is what a cold prompt meets there. (Each worker's own figure at the moment also varies with how busy it
happened to be: identical L4s read 730-2,700 tokens/s at once, which is why the kind's best is taken.)

S(w) is the shortest engine step the kind has shown, the time between two tokens of a stream when the engine
ran least beside it: a first token comes at the end of a step, and a step reads the model's weights once
whatever it computes, so this is the least any request waits there (an 8B model: ~8 ms on an H100, ~70 ms on
an L4, from memory bandwidth). A longer gap measured under load is the batch's doing, which the latency model
counts apart (its requests in flight); the shortest is the card's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from poolgate.kernel.fleet import WorkerRecord

Kind = tuple[str, int, float]


class KindRates:
    """The peak prefill rate and the shortest step per worker kind, folded in from every record it is shown."""

    __slots__ = ("_best", "_peak", "_step", "_unknown", "default_rate")

    def __init__(self, default_rate: float) -> None:
        self.default_rate = default_rate
        self._peak: dict[Kind, float] = {}
        self._step: dict[Kind, float] = {}
        self._best: dict[Kind, tuple[float, float]] = {}
        """(R, S) per kind, as the pick reads them: one look-up per candidate."""
        self._unknown = (default_rate, 0.0)

    def observe(self, workers: Iterable[WorkerRecord]) -> None:
        """Fold records in; one shown again changes nothing, so callers pass what changed when they know it
        (nothing is kept per worker: the state is one figure per kind, however many workers come and go)."""
        peak, step = self._peak, self._step
        for worker in workers:
            rate, gap = worker.prefill_tokens_per_s, worker.inter_token_s
            if rate <= 0 and gap <= 0:
                continue
            kind = (worker.model, worker.kv_capacity_tokens, worker.gpu_memory_total_mib)
            faster, shorter = rate > peak.get(kind, 0.0), 0 < gap < step.get(kind, math.inf)
            if faster:
                peak[kind] = rate
            if shorter:
                step[kind] = gap
            if faster or shorter:
                self._best[kind] = (peak.get(kind, self.default_rate), step.get(kind, 0.0))

    def of(self, worker: WorkerRecord) -> float:
        """R(w)."""
        return self.rate_and_step(worker)[0]

    def rate_and_step(self, worker: WorkerRecord) -> tuple[float, float]:
        """R(w) and S(w) (0 while no step is known), with one look-up of w's kind (the pick's hot loop)."""
        return self._best.get((worker.model, worker.kv_capacity_tokens, worker.gpu_memory_total_mib), self._unknown)
