"""The one registry of scheduling plugins: filters, scorers and pickers by their snake_case names.

Each entry builds its plugin from the ``scheduling`` section (a filter's factory may answer None: switched
off, the pick pays nothing for it). Filters run in the registry's order: those that judge the request (task
class, context length) before those that judge the workers' present load, whose refusal is a ``NoCapacity``
the queue may wait out. ``scheduling.weights`` picks the scorers by name, and ``check`` validates it against
the registry with the field path.

A new scorer is one module under ``scorers/`` and one entry in ``SCORERS`` (and its default weight in the
configuration, which names every scorer the product ships; ``Registry.with_scorer`` extends the registry
without it, as tests do).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from extproc.scheduling.backlog import PrefillBacklogGate
from extproc.scheduling.filters import (
    FitsContext,
    GpuMemoryWatermark,
    KvFits,
    ReadyAndFresh,
    TaskClassPools,
    TenantPools,
)
from extproc.scheduling.lora_filter import AdapterRoom
from extproc.scheduling.picker import MaxScore
from extproc.scheduling.plugins import Filter, Picker, Scorer
from extproc.scheduling.saturation import SaturationGate
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.cache_aware_ttft import CacheAwareTtft
from extproc.scheduling.scorers.kv_headroom import KvHeadroom
from extproc.scheduling.scorers.latency import PredictedLatency
from extproc.scheduling.scorers.least_inflight import LeastInflight
from extproc.scheduling.scorers.lora_affinity import LoraAffinity
from extproc.scheduling.scorers.predicted_ttft import PredictedTtft
from extproc.scheduling.scorers.prefix_affinity import PrefixAffinity
from poolgate.kernel.config import ConfigError, SchedulingSettings

FilterFactory = Callable[[SchedulingSettings], Filter | None]
ScorerFactory = Callable[[SchedulingSettings], Scorer]
PickerFactory = Callable[[SchedulingSettings, random.Random | None], Picker]


def _saturation_gate(s: SchedulingSettings) -> SaturationGate | None:
    if not (s.max_inflight_per_worker or s.queue_when_waiting):
        return None
    return SaturationGate(s.max_inflight_per_worker, s.lower_class_inflight_fraction, s.queue_when_waiting,
                          s.retry_after_s)


def _prefill_backlog_gate(s: SchedulingSettings) -> PrefillBacklogGate | None:
    if not s.max_prefill_backlog_s:
        return None
    return PrefillBacklogGate(s.max_prefill_backlog_s, s.default_prefill_tokens_per_s, s.retry_after_s)


FILTERS: Mapping[str, FilterFactory] = MappingProxyType({
    "tenant_pools": lambda s: TenantPools(s.retry_after_s),
    "task_class": lambda s: TaskClassPools(),
    "ready_and_fresh": lambda s: ReadyAndFresh(s.retry_after_s),
    "fits_context": lambda s: FitsContext(),
    "gpu_memory": lambda s: GpuMemoryWatermark(s.gpu_memory_min_free_mib, s.retry_after_s),
    "kv_fits": lambda s: KvFits(s.kv_reserve_fraction, s.retry_after_s),
    "lora_room": lambda s: AdapterRoom(),
    "saturated": _saturation_gate,
    "prefill_backlog": _prefill_backlog_gate,
})
SCORERS: Mapping[str, ScorerFactory] = MappingProxyType({
    "predicted_ttft": lambda s: PredictedTtft(s.default_prefill_tokens_per_s, s.ttft_reference_s),
    "kv_headroom": lambda s: KvHeadroom(s.kv_reserve_fraction),
    "inflight": lambda s: LeastInflight(),
    "prefix_affinity": lambda s: PrefixAffinity(),
    "lora_affinity": lambda s: LoraAffinity(),
    "cache_aware_ttft": lambda s: CacheAwareTtft(s.default_prefill_tokens_per_s, s.ttft_reference_s),
    "latency": lambda s: PredictedLatency(s.default_prefill_tokens_per_s),
})
PICKERS: Mapping[str, PickerFactory] = MappingProxyType({
    "max_score": lambda s, rng: MaxScore(rng),
})
DEFAULT_PICKER = "max_score"


@dataclass(frozen=True, slots=True)
class Registry:
    filters: Mapping[str, FilterFactory]
    scorers: Mapping[str, ScorerFactory]
    pickers: Mapping[str, PickerFactory]

    def with_scorer(self, name: str, factory: ScorerFactory) -> Registry:
        return Registry(self.filters, MappingProxyType({**self.scorers, name: factory}), self.pickers)

    def settings(self, section: Mapping[str, Any]) -> SchedulingSettings:
        """A ``scheduling`` section validated against this registry's scorers; ConfigError names the field."""
        try:
            return SchedulingSettings.model_validate(section, context={"scorer_names": tuple(self.scorers)})
        except ValidationError as exc:
            problems = "; ".join(f"scheduling.{'.'.join(str(p) for p in e['loc'])}: "
                                 f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
            raise ConfigError(problems) from None

    def check(self, settings: SchedulingSettings) -> None:
        """ConfigError, with the field path, for a scorer name the registry does not hold."""
        unknown = sorted(set(settings.weights) - set(self.scorers))
        if unknown:
            raise ConfigError(f"scheduling.weights: unknown scorer {', '.join(unknown)}; known: "
                              f"{', '.join(self.scorers)}")

    def build_filters(self, settings: SchedulingSettings) -> list[Filter]:
        built = (factory(settings) for factory in self.filters.values())
        return [f for f in built if f is not None]

    def build_scorers(self, settings: SchedulingSettings) -> dict[str, Scorer]:
        """Every scorer by its name (weighted or not)."""
        return {name: factory(settings) for name, factory in self.scorers.items()}

    def scheduler(self, settings: SchedulingSettings, rng: random.Random | None = None,
                  picker: str = DEFAULT_PICKER) -> Scheduler:
        """The resource-aware policy: every filter switched on, the configured weighted sum of scorers, the
        picker (its random source breaks ties)."""
        self.check(settings)
        scorers = self.build_scorers(settings)
        return Scheduler(
            filters=self.build_filters(settings),
            scorers=[(scorers[name], settings.weights.get(name, 0.0)) for name in self.scorers],
            picker=self.pickers[picker](settings, rng),
            explain=settings.debug_header,
            rng=rng,
        )


PLUGINS = Registry(FILTERS, SCORERS, PICKERS)


def build_scheduler(settings: SchedulingSettings, rng: random.Random | None = None) -> Scheduler:
    return PLUGINS.scheduler(settings, rng)


def default_scheduler(rng: random.Random | None = None, settings: SchedulingSettings | None = None) -> Scheduler:
    return build_scheduler(settings or SchedulingSettings(), rng)
