"""A deterministic stand-in tokenizer and the filler text the simulated model "generates".

The tokenizer and chat template themselves live in ``poolgate.kernel.sim_tokenizer``, which the router
imports too (it must make the same token ids to look prompts up in the KV-event index).

Tokens are chat-template markers (``<|start|>``), runs of up to 8 word characters, or single
punctuation marks. English prose comes out near 1.2 tokens per word (~4-5 characters per token),
close to a BPE tokenizer, and the same text always gives the same count, which is all the simulator
needs: KV sizing, ``usage`` numbers and prefix-cache hashes agree with each other.

Chat messages are rendered through a small template, ``<|start|>role<|sep|>content<|end|>`` per
message plus ``<|start|>assistant<|sep|>`` to prime the reply, so a message costs 3 tokens plus its
role (``user``: 1, ``assistant``: 2) and the priming 4 more, like Llama-3's header tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from poolgate.kernel.sim_tokenizer import render_chat, token_ids, tokenize

__all__ = ["FILLER_WORDS", "block_hashes", "filler_token", "render_chat", "stable_hash", "token_ids", "tokenize"]

FILLER_WORDS = (
    "the", "model", "answers", "with", "virtual", "tokens", "that", "carry", "no", "meaning", "but",
    "have", "a", "steady", "length", "so", "routing", "can", "be", "measured", "fairly", "across",
    "workers", "and", "policies", "while", "cache", "blocks", "fill", "up", "then", "drain", "again",
)


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def block_hashes(tokens: Sequence[str], block_size: int) -> tuple[int, ...]:
    """Chained hashes of each full block of tokens: equal hashes mean equal prefixes, as in vLLM."""
    hashes: list[int] = []
    previous = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(previous + "\x1f".join(tokens[start:start + block_size]).encode(),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(hashes)


def filler_token(seed: int, index: int) -> str:
    """The ``index``-th generated token of a request: a space and a word (one token each)."""
    return " " + FILLER_WORDS[(seed + index * 7) % len(FILLER_WORDS)]
