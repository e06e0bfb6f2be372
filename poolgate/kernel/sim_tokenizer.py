"""The simulated models' tokenizer and chat template, shared by the simulated worker and the router.

The simulated worker tokenises prompts with it, and extproc must make the very same token ids to look a
prompt up in the KV-event index, so the one definition lives here, below both (extproc never imports the
simulator). Tokens are chat-template markers (``<|start|>``), runs of up to 8 word characters, or single
punctuation marks: English prose comes out near 1.2 tokens per word, close to a BPE tokenizer.

Chat messages render as ``<|start|>role<|sep|>content<|end|>`` each, plus ``<|start|>assistant<|sep|>``
to prime the reply (like Llama-3's header tokens).

Token ids: a token of decimal digits below 2**31 is that number (so a completions prompt given as token
ids and the same ids written as text agree); any other token is ``2**31 + blake2b(token) mod 2**31``, the
same in every process. Ids are memoised per token text: a 16k-token prompt repeats a few thousand
distinct tokens, so ids cost a dictionary look-up each after the first sight.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

_TOKEN = re.compile(r"<\|\w+\|>|\w{1,8}|[^\w\s]")
_ID_SPACE = 2**31
_MEMO_LIMIT = 1 << 20
_ids: dict[str, int] = {}


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text a chat request turns into (role, content) -> template."""
    parts = [f"<|start|>{role}<|sep|>{content}<|end|>" for role, content in messages]
    parts.append("<|start|>assistant<|sep|>")
    return "".join(parts)


def token_id(token: str) -> int:
    known = _ids.get(token)
    if known is not None:
        return known
    if token.isdecimal() and token.isascii() and int(token) < _ID_SPACE:
        value = int(token)
    else:
        digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
        value = _ID_SPACE + int.from_bytes(digest, "big") % _ID_SPACE
    if len(_ids) < _MEMO_LIMIT:
        _ids[token] = value
    return value


def token_ids(tokens: Sequence[str]) -> list[int]:
    return [token_id(token) for token in tokens]
