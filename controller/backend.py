"""The one small interface every instance backend implements (local processes, Kubernetes).

A backend knows how to add workers to a pool, stop or restart one, and which workers it runs. Draining,
health and scaling decisions live elsewhere and only call these four verbs.
"""

from __future__ import annotations

from typing import Protocol

from poolgate.kernel.errors import Refused


class PlacementRefused(Refused):
    """No capacity fits the worker (e.g. no GPU with enough free memory); the message says why."""


class InstanceBackend(Protocol):
    name: str

    def owns(self, worker_id: str) -> bool:
        """Whether this backend started the worker (and so may stop or restart it)."""

    async def pool_workers(self, pool: str) -> list[str]:
        """Workers of the pool this backend runs or is starting (not those being stopped)."""

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        """Start ``count`` more workers from the pool's template; returns their ids where known."""

    async def stop(self, worker_id: str) -> None:
        """Stop one worker for good; called after its drain."""

    async def restart(self, worker_id: str) -> None:
        """Replace one worker's process with a fresh one (same id and address where possible)."""
