"""The router's own block keys, computed from token ids, so the index never depends on the engine's hash.

key_0 = H(root(lora), tokens_0), key_i = H(key_{i-1}, tokens_i), where tokens_i are the i-th block's
``block_size`` token ids and root(lora) separates an adapter's blocks from the base model's (vLLM puts the
adapter in its block hash too). Only whole blocks have keys, as only whole blocks are cached. H is
Python's tuple hash of ints: about 0.1 µs a block, and the same in every process of one Python version (only
str and bytes hashes are salted per process); a collision (2**-64) costs one wrong guess of a warm worker.
Equal keys on two workers mean the same prefix, whatever seeds their engines hash with.

Keys leave the process: the processes of a host tell each other the blocks they placed (``siblings``), and
replicas on other hosts read them from Redis (``peers``). So a root is a fixed digest of its name, not
Python's ``hash`` of a string: with that, every process had its own roots, and the blocks another process
placed never matched a key here.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence


def _digest(name: str) -> int:
    """A signed 64-bit digest of ``name``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


BASE_ROOT = _digest("poolgate-kv-root")


@functools.lru_cache(maxsize=1024)
def root_key(lora_name: str | None) -> int:
    return BASE_ROOT if lora_name is None else _digest("poolgate-kv-root:" + lora_name)


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of the whole blocks of ``token_ids``, chained on from ``parent``."""
    keys: list[int] = []
    ids = tuple(token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[start:start + block_size]))
        keys.append(parent)
    return keys


def prompt_keys(token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> tuple[int, ...]:
    return tuple(chain_keys(root_key(lora_name), token_ids, block_size))
