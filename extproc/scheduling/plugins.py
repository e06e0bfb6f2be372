"""The shapes shared by every scheduling plugin, and the decision a pick returns.

Every filter has the same signature, every scorer has the same signature; the scheduler never needs to know
which plugin it is calling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.snapshot import FleetSnapshot
from poolgate.fleet import WorkerRecord


@dataclass(frozen=True, slots=True)
class PickContext:
    """Everything a plugin may look at besides the request: the fleet and the live in-flight counts."""

    snapshot: FleetSnapshot
    inflight: Mapping[str, int]
    """Worker id → requests in flight across all extproc replicas (as known to this one)."""


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    pool: str
    cluster: str
    """Envoy cluster name; extproc sets it in the cluster header."""
    endpoint: str
    """``ip:port`` of the picked worker."""
    fallbacks: tuple[str, ...] = ()
    """Further ``ip:port`` of the same pool, in order, for Envoy to try if the first is unavailable."""

    @property
    def pin(self) -> str:
        """The value of the endpoint-pin metadata: a comma list, best first."""
        return ",".join((self.endpoint, *self.fallbacks))


class Filter(Protocol):
    """Keeps the candidates that may serve the request; explains itself when none is left."""

    name: str

    def filter(
        self, facts: RequestFacts, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]: ...

    def rejection(self, facts: RequestFacts, context: PickContext) -> ApiError: ...


class Scorer(Protocol):
    """Rates each candidate in [0, 1] (higher is better), returned in the candidates' order."""

    name: str

    def score(
        self, facts: RequestFacts, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]: ...
