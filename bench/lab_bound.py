"""The least time to first token any router could give each request of a trace: a lower bound, not a policy.

For request r (in the trace's order) with a prompt of P tokens:

    c_r = the tokens of the leading blocks of r's prompt that an earlier request's prompt also holds, at most
          ⌊(P − 1) / 16⌋ (the engine computes a prompt's last token even when every block is cached)
    b_r = the least over the kinds of engine serving r's model of the prefill of the P − c_r tokens left on
          an idle engine of that kind: chunks of its batched-token budget, each step timed by the simulator's
          step model with the c_r cached tokens and the chunks before it as context, no jitter

Whatever a router does, r's first token comes after its uncached tokens are computed on one engine, which
takes at least the steps of b_r: other sequences in a step only lengthen it, and a block no earlier request
holds is in no cache when r arrives (an earlier request's blocks are counted cached even if they are still
being computed, which only lowers the bound). So every request's time to first token is at least b_r, and
the p99 of the times any router gives is at least the p99 of the b_r (order statistics keep the order). A
target below that figure is one no router meets on that trace.

Where the lab's cells sit against it: the prefill of the longest prompts and of documents no earlier request
sent sets the bound; queueing behind others' prefills (a burst, a cold start) is what routers add to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from bench.lab_fleet import BLOCK_SIZE
from bench.lab_routers import LabRequest
from bench.measure import percentile
from simworker.engine import reusable_blocks
from simworker.presets import PRESETS, ModelShape, StepCost, attention_pairs, step_cost


def prefill_alone_s(uncached: int, cached: int, cost: StepCost, budget: int) -> float:
    """Seconds an idle engine takes to compute ``uncached`` prompt tokens after ``cached`` ones, chunked by
    ``budget`` tokens a step; the first token comes with the step that computes the last of them."""
    seconds, computed = 0.0, cached
    while uncached > 0:
        chunk = min(budget, uncached)
        seconds += cost.step_seconds(chunk, computed, attention_pairs(computed, chunk))
        computed += chunk
        uncached -= chunk
    return seconds


def kinds_of(presets_by_model: Mapping[str, Iterable[str]]) -> dict[str, list[tuple[StepCost, int]]]:
    """Model → the step cost and batched-token budget of each kind of engine serving it."""
    shape = ModelShape()
    return {model: [(step_cost(PRESETS[name], shape), PRESETS[name].max_num_batched_tokens) for name in set(presets)]
            for model, presets in presets_by_model.items()}


def bounds(requests: Sequence[LabRequest], presets_by_model: Mapping[str, Iterable[str]]) -> list[tuple[float, int]]:
    """Per request, in order: (b_r in seconds, c_r in tokens)."""
    kinds = kinds_of(presets_by_model)
    seen: set[tuple[str, int]] = set()
    out: list[tuple[float, int]] = []
    for request in requests:
        engine = request.engine
        prompt = engine.prompt_tokens
        hashes = engine.prompt_block_hashes
        reusable = min(reusable_blocks(prompt, BLOCK_SIZE), len(hashes))
        cached_blocks = 0
        while cached_blocks < reusable and (request.model, hashes[cached_blocks]) in seen:
            cached_blocks += 1
        cached = cached_blocks * BLOCK_SIZE
        least = min(prefill_alone_s(prompt - cached, cached, cost, budget) for cost, budget in kinds[request.model])
        out.append((least, cached))
        seen.update((request.model, h) for h in hashes)
    return out


def bound_row_figures(requests: Sequence[LabRequest],
                      presets_by_model: Mapping[str, Iterable[str]]) -> dict[str, float]:
    """The bound's p50 and p99, the share of requests whose bound is within their class's objective (the
    most goodput any router could have) and the share of prompt tokens an earlier request held (the most
    prefix hits)."""
    per_request = bounds(requests, presets_by_model)
    seconds = [s for s, _ in per_request]
    prompt_tokens = sum(r.engine.prompt_tokens for r in requests)
    return {
        "ttft_p50_s": percentile(seconds, 0.50), "ttft_p99_s": percentile(seconds, 0.99),
        "goodput": (sum(1 for r, s in zip(requests, seconds, strict=True) if s <= r.slo_ttft_s) / len(requests)
                    if requests else math.nan),
        "prefix_hit": sum(c for _, c in per_request) / prompt_tokens if prompt_tokens else 0.0,
    }
