"""Long prompts: affinity keys are built from the prompt's leading chunks only (no copy of a 1 MB prompt)
and are the very keys of hashing the model name and the whole joined prompt's leading text at once (the same
in every process)."""

from __future__ import annotations

import zlib

from hypothesis import given
from hypothesis import strategies as st

from extproc.request import RequestFacts
from extproc.scheduling.estimate import prefix_keys


def keys_of_whole_prompt(facts: RequestFacts, chunk_chars: int, max_chunks: int) -> list[int]:
    text = "\x1f".join(facts.prompt_parts)
    keys = []
    for index in range(min(len(text) // chunk_chars, max_chunks)):
        prefix = facts.model + text[:(index + 1) * chunk_chars]
        keys.append(zlib.crc32(prefix.encode("utf-8", "surrogatepass")))
    return keys[::-1]


@given(st.lists(st.text(alphabet="ab\x1f", max_size=40), min_size=1, max_size=5), st.integers(1, 9),
       st.integers(1, 6))
def test_prefix_keys_equal_those_of_the_whole_joined_prompt(parts: list[str], chunk: int, chunks: int) -> None:
    facts = RequestFacts(path="/v1/chat/completions", method="POST", model="m", prompt_parts=tuple(parts))
    assert list(prefix_keys(facts, chunk, chunks)) == keys_of_whole_prompt(facts, chunk, chunks)

