"""The paged KV cache: a fixed pool of blocks, optionally shared between equal prompt prefixes.

A sequence holds ``ceil(tokens / block_size)`` blocks: some private, and (with prefix caching) a
leading run of shared blocks keyed by their chained hash. A shared block whose last user finished is
kept as an evictable cache entry: it counts as free (vLLM's usage is ``1 - free / total``) but a
later prompt with the same prefix reuses it until an allocation evicts it, least recently used first.
Leaked blocks (a fault) are taken out of the pool for good.

With an event sink (``kv_events.KVEventSink``) the cache reports what vLLM's block pool reports: a block
newly published under its hash, a cached block evicted, the whole prefix cache reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from simworker.kv_events import KVEventSink


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 events: KVEventSink | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._private_blocks = 0
        self._shared_refcounts: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._leaked_blocks = 0
        self._events = events

    @property
    def used_blocks(self) -> int:
        return self._private_blocks + len(self._shared_refcounts) + self._leaked_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take, evictable cache entries included."""
        return self.num_blocks - self.used_blocks

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def leaked_blocks(self) -> int:
        return self._leaked_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt are already in the cache."""
        if not self.enable_prefix_caching:
            return 0
        hits = 0
        for block_hash in hashes:
            if block_hash not in self._shared_refcounts and block_hash not in self._evictable:
                break
            hits += 1
        return hits

    def evictable_among(self, hashes: Sequence[int]) -> int:
        return sum(1 for block_hash in hashes if block_hash in self._evictable)

    def acquire_shared(self, hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (caller checked ``cached_prefix_blocks``)."""
        for block_hash in hashes:
            if block_hash in self._evictable:
                del self._evictable[block_hash]
                self._shared_refcounts[block_hash] = 1
            else:
                self._shared_refcounts[block_hash] += 1

    def allocate(self, blocks: int) -> bool:
        """Reserve private blocks, evicting cached prefixes if needed; False if they do not fit."""
        if blocks > self.free_blocks:
            return False
        self._evict(blocks - (self.free_blocks - len(self._evictable)))
        self._private_blocks += blocks
        return True

    def share_private_block(self, block_hash: int, parent_hash: int | None = None,
                            token_ids: tuple[int, ...] = ()) -> None:
        """A sequence finished computing a full prompt block: publish it under its hash.

        If an equal block is already cached (two equal prompts prefilled side by side), the sequence
        switches to the cached copy and its private block goes back to the pool.
        """
        self._private_blocks -= 1
        if self._is_cached(block_hash):
            self.acquire_shared([block_hash])
        else:
            self._shared_refcounts[block_hash] = 1
            if self._events is not None:
                self._events.block_stored(block_hash, parent_hash, token_ids)

    def release(self, private_blocks: int, shared_hashes: Sequence[int]) -> None:
        self._private_blocks -= private_blocks
        for block_hash in reversed(shared_hashes):  # a prefix's tail is evicted before its head
            remaining = self._shared_refcounts[block_hash] - 1
            if remaining:
                self._shared_refcounts[block_hash] = remaining
            else:
                del self._shared_refcounts[block_hash]
                self._evictable[block_hash] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's block pool does: refused (False) while any block is held,
        by a sequence or by a leak, since a held block's hash cannot be dropped under its user."""
        if self.used_blocks:
            return False
        self._evictable.clear()
        if self._events is not None:
            self._events.all_cleared()
        return True

    def leak(self, blocks: int) -> int:
        """Lose up to ``blocks`` free blocks for good (fault injection); returns how many were lost."""
        lost = min(blocks, self.free_blocks)
        self._evict(lost - (self.free_blocks - len(self._evictable)))
        self._leaked_blocks += lost
        return lost

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least recently used cached blocks (no-op for ``count`` <= 0)."""
        for _ in range(max(0, count)):
            block_hash, _ = self._evictable.popitem(last=False)
            if self._events is not None:
                self._events.block_removed(block_hash)

    def _is_cached(self, block_hash: int) -> bool:
        return block_hash in self._shared_refcounts or block_hash in self._evictable
