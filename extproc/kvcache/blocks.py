"""What the scheduler gets to know about a request's prompt and the workers' caches (pure values)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from poolgate.kernel.fleet import WorkerRecord


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt tokenised as the engine will tokenise it, as router block keys per engine block size."""

    token_count: int
    keys: Mapping[int, tuple[int, ...]]
    """Engine block size → the keys of the prompt's whole blocks (``keys.prompt_keys``)."""


class PrefixCacheView(Protocol):
    """The index as a pick reads it: exact cached-prefix lengths of the workers whose streams are in sync."""

    def cached_tokens(self, blocks: PromptBlocks, candidates: Sequence[WorkerRecord],
                      pending: bool = True) -> Mapping[str, int]:
        """Worker id → prompt tokens its cache holds (the engine reuses at most ``token_count - 1``);
        candidates whose cache is unknown are absent. ``pending``: count the blocks of prompts this replica
        just placed there as held (where the next request will find them once computed); False: only what
        the worker's events confirmed (what a request can share now, so need not allocate)."""
        ...

    def held_tokens(self, worker: WorkerRecord) -> int | None:
        """Tokens of every block the worker's cache holds (in use or kept for reuse); None = unknown."""
        ...
