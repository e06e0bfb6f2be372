"""Candidate sampling: a model served by hundreds of workers is picked over a random sample of them.

Every filter and scorer costs about a microsecond per candidate, so a pick over one pool of 1,000 workers
took ~1.7 ms. Above ``SAMPLE_ABOVE`` Ready candidates the scheduler runs the same filters and scorers over
``SAMPLE_SIZE`` of them drawn uniformly (power of k choices: the best of 32 random workers is, in
expectation, better than 97 % of the pool), plus every worker a scorer would single out that a uniform
draw could miss: the workers the request's affinity keys (session, prompt prefix) point at. Because the
filters run on the sample, a sampled pick never chooses a worker a filter drops; when they leave nothing
of the sample, the pick is made again over every candidate, so a refusal is always the whole fleet's.

Not sampled: models with at most ``SAMPLE_ABOVE`` Ready workers (small pools keep the exact best),
LoRA requests (the workers holding the adapter matter) and requests the KV-event index knows exactly
(the latency model looks for the workers whose cache holds the prompt).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.scheduling.plugins import PickContext, PickRequest
from poolgate.kernel.fleet import WorkerRecord

SAMPLE_ABOVE = 64
"""Ready workers of a model above which picks are made over a sample."""
SAMPLE_SIZE = 32
"""Workers drawn per sampled pick (besides those the affinity keys name)."""


def should_sample(request: PickRequest, context: PickContext, ready: Sequence[WorkerRecord]) -> bool:
    if len(ready) <= SAMPLE_ABOVE or request.adapter is not None:
        return False
    return request.prompt_blocks is None or context.prefix_cache is None


def sample(request: PickRequest, context: PickContext, ready: Sequence[WorkerRecord],
           rng: random.Random) -> list[WorkerRecord]:
    """``SAMPLE_SIZE`` draws from ``ready`` at random, plus the workers the request's affinity keys name (when they
    serve its model), in the snapshot's order so a pick's ties and fallbacks read as over the whole list."""
    count, draw = len(ready), rng.random
    drawn = {worker.id: worker for worker in [ready[int(draw() * count)] for _ in range(SAMPLE_SIZE)]}
    # With replacement: a repeat (half a draw on average at 1,000 workers) only makes the sample one smaller,
    # and ``rng.sample`` costs several times as much.
    if request.affinity_keys:
        by_id = context.snapshot.by_id
        affinity = context.affinity
        for key in request.affinity_keys:
            worker_id = affinity.get(key)
            worker = by_id.get(worker_id) if worker_id is not None else None
            if worker is not None and worker_id not in drawn and request.model in (
                    *worker.names, context.snapshot.pools[worker.pool].model):
                drawn[worker.id] = worker
    return sorted(drawn.values(), key=lambda w: w.id)
