"""Cheap token estimates for a request, before any tokenizer runs.

``prompt_tokens_lower_bound`` errs low on purpose: it is used to refuse requests that cannot fit, and a
request must never be refused that the engine would have accepted. Tokenizers of current LLMs average
3–5 characters per token on prose and code; 8 leaves room for long whitespace runs and rare words.
"""

from __future__ import annotations

from extproc.request import RequestFacts

MAX_CHARS_PER_TOKEN = 8


def prompt_tokens_lower_bound(facts: RequestFacts) -> int:
    return facts.prompt_token_ids + facts.prompt_chars // MAX_CHARS_PER_TOKEN


def tokens_needed_lower_bound(facts: RequestFacts) -> int:
    """Prompt plus the output the client asked room for (at least one token)."""
    return prompt_tokens_lower_bound(facts) + (facts.max_tokens or 1)
