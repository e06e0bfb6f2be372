"""The shapes shared by every scheduling plugin, and the outcomes a pick returns.

Every filter has the same signature, every scorer has the same signature; the scheduler never needs to know
which plugin it is calling. A plugin reads the request (``PickRequest``: parsed facts plus the estimates made
before the pick) and the context (``PickContext``: the frozen fleet plus extproc's own accounting), and
nothing else: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from types import MappingProxyType
from typing import Generic, Protocol, TypeAlias, TypeVar, overload

from extproc.errors import ApiError
from extproc.kvcache.blocks import PrefixCacheView, PromptBlocks
from extproc.request import RequestFacts
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.config import SchedulingSettings, Section, TaskClass
from poolgate.kernel.fleet import WorkerRecord

_EMPTY: Mapping[str, int] = MappingProxyType({})
_NO_AFFINITY: Mapping[Hashable, str] = MappingProxyType({})


class LatestPrefill(Protocol):
    """The prefill of the latest requests placed on a worker (``extproc/prefill_ledger.py``)."""

    def latest_tokens(self, worker_id: str, requests: int) -> int | None: ...


@dataclass(frozen=True, slots=True)
class PickRequest:
    """One request as the scheduler sees it: what was asked and what it is expected to cost."""

    facts: RequestFacts
    prompt_tokens: int
    """Estimated prompt tokens (template overhead included)."""
    min_prompt_tokens: int
    """A count the real prompt cannot be below; the only one allowed to refuse a request as too long."""
    output_tokens: int
    """Expected output tokens: ``max_tokens`` when given, else the configured default."""
    task_class: TaskClass
    affinity_keys: tuple[Hashable, ...] = ()
    """Keys of the affinity map, strongest first: the session key, then prompt-prefix hashes longest first."""
    only_pools: frozenset[str] | None = None
    """The tenant may use only these pools (its dedicated ones); None = no restriction."""
    excluded_pools: frozenset[str] = frozenset()
    """Pools dedicated to other tenants."""
    priority: int = 0
    """The tenant's priority class (0 = highest); the saturation gate keeps headroom for class 0."""
    adapter: str | None = None
    """LoRA adapter the request names (``model`` is then its base); None for a plain model request."""
    prompt_blocks: PromptBlocks | None = None
    """The prompt as the engine tokenises it, in block keys (``kvcache.lookup``); None = not tokenised."""
    held_s: float = 0.0
    """How long the request has waited in extproc's queue so far (the prefill-backlog gate loosens by it)."""

    @property
    def model(self) -> str:
        return self.facts.model

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class PickContext:
    """Everything a plugin may look at besides the request: the fleet and extproc's own accounting."""

    snapshot: FleetSnapshot
    inflight: Mapping[str, int]
    """Worker id → requests in flight across all extproc replicas (as known to this one)."""
    reserved_kv_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Worker id → KV tokens this replica placed there that the worker's record does not show yet, plus the
    decode room of requests still streaming there."""
    pending_prefill_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Worker id → prompt tokens this replica placed there that the record does not show yet."""
    affinity: Mapping[Hashable, str] = field(default_factory=lambda: _NO_AFFINITY)
    """Affinity key (session or prompt prefix) → worker that last took a request with it."""
    prefix_cache: PrefixCacheView | None = None
    """What the workers' KV events say their caches hold; None = no worker publishes them."""
    latest_prefill: LatestPrefill | None = None
    """The prefill of the latest requests placed on each worker, this replica's and the others' it knows of
    (``prefill_ledger``)."""


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
    scores: tuple[tuple[str, float], ...] = ()
    """Per-scorer scores of the picked worker, filled only when the scheduler explains itself."""

    @property
    def pin(self) -> str:
        """The value of the endpoint-pin metadata: a comma list, best first."""
        return ",".join((self.endpoint, *self.fallbacks))


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """Ready workers exist but none has room for the request now; it may be held and tried again."""

    model: str
    reason: str
    """The ``reason`` of the filter that left no candidate (``kv-fits``, ``gpu-memory``, ``saturated``): label
    values of ``poolgate_extproc_pick_refusals`` as published, while the filters' registry names are
    snake_case."""
    retry_after_s: int


Refusal: TypeAlias = ApiError | NoCapacity
Outcome: TypeAlias = Decision | Refusal


class Filter(Protocol):
    """Keeps the candidates that may serve the request; explains itself when none is left."""

    name: str

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]: ...

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal: ...


class SameScore(Sequence[float]):
    """One score for every candidate: what a scorer with no opinion on this request returns (no adapter asked
    for, no affinity known, every candidate alike). The scheduler adds nothing for it, since the same amount on
    every total changes no choice, and nothing is allocated per candidate."""

    __slots__ = ("_count", "value")

    def __init__(self, count: int, value: float = 0.0) -> None:
        self._count = count
        self.value = value

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> float: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...

    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        if isinstance(index, slice):
            return [self.value] * len(range(*index.indices(self._count)))
        if not -self._count <= index < self._count:
            raise IndexError(index)
        return self.value

    def __iter__(self) -> Iterator[float]:
        return repeat(self.value, self._count)


class Scorer(Protocol):
    """Rates each candidate in [0, 1] (higher is better), returned in the candidates' order (``SameScore``
    where it rates them all alike)."""

    name: str

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]: ...


class Picker(Protocol):
    """Chooses one candidate from their weighted totals; ``full_score`` is the total of a candidate that scored
    1 on every scorer (the sum of the weights), the scale any tolerance is relative to."""

    name: str

    def choose(self, totals: Sequence[float], full_score: float) -> int: ...


class NoSettings(Section):
    """A plugin without parameters of its own (an empty mapping, or none, under its name)."""


SettingsT = TypeVar("SettingsT", bound=Section)


@dataclass(frozen=True, slots=True)
class ScorerPlugin(Generic[SettingsT]):
    """What a scorer module declares as ``PLUGIN``: the registry finds it there (one module, nothing else).

    ``settings`` validates ``scheduling.scorer_settings.<name>``; ``build`` makes the scorer from those and the
    shared section (for the few values every plugin shares, such as ``default_prefill_tokens_per_s``);
    ``default_weight`` is its weight when ``scheduling.weights`` is not set."""

    name: str
    build: Callable[[SettingsT, SchedulingSettings], Scorer]
    settings: type[SettingsT]
    default_weight: float = 0.0


@dataclass(frozen=True, slots=True)
class FilterPlugin(Generic[SettingsT]):
    """What a filter declares: ``settings`` validates ``scheduling.filter_settings.<name>``; ``build`` may answer
    None (switched off: the pick pays nothing for it)."""

    name: str
    build: Callable[[SettingsT, SchedulingSettings], Filter | None]
    settings: type[SettingsT]
