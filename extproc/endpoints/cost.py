"""How an endpoint's request turns into tokens where chat's rule does not fit, and how much decode room it needs.

The profiler (``scheduling.estimate``) counts a request's prompt as usual (text estimate plus exact tokens, plus
the chat template's overhead for endpoints with one) and then applies this:

- ``prompt_tokens = 0`` when ``free`` (tokenize, detokenize: the worker's API server answers them, no GPU
  work), else the usual count;
- ``output_tokens = output_tokens`` when set (0 for pooling: embeddings and scores are prefill-only, no decode
  room; an audio estimate), else ``max_tokens`` or the configured default, as for chat;
- ``min_prompt_tokens = longest_token_ids + longest_chars // 8``: the longest single sequence, not the sum,
  because a batch (embedding inputs, score pairs, audio chunks) runs as separate sequences and each only has
  to fit the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointCost:
    output_tokens: int | None = None
    longest_chars: int = 0
    longest_token_ids: int = 0
    free: bool = False


FREE = EndpointCost(free=True)


def apply_cost(cost: EndpointCost, counted_prompt: int, requested_output: int,
               max_chars_per_token: int) -> tuple[int, int, int]:
    """(prompt tokens, min prompt tokens, output tokens), given the usual prompt count and the output chat would
    reserve (``max_tokens`` or the default)."""
    if cost.free:
        return 0, 0, 0
    output = requested_output if cost.output_tokens is None else cost.output_tokens
    return counted_prompt, cost.longest_token_ids + cost.longest_chars // max_chars_per_token, output
