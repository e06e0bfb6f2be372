"""The one registry of scheduling plugins: filters, scorers and pickers by their snake_case names.

A scorer is one module of ``scorers/`` that declares ``PLUGIN = ScorerPlugin(name, build, settings,
default_weight)``: ``discover`` imports every module of that package and registers the ones that declare one,
so a new scorer is one new file. Its own parameters live under ``scheduling.scorer_settings.<name>`` and are
validated by its settings model; the values every plugin shares (``default_prefill_tokens_per_s``,
``retry_after_s``, ...) stay in the ``scheduling`` section and reach each factory with it.

Filters declare themselves the same way (``FilterPlugin``, parameters under ``scheduling.filter_settings``), but
their order is part of the policy, so ``FILTERS`` lists them: those that judge the request (task class,
context length) before those that judge the workers' present load, whose refusal is a ``NoCapacity`` the
queue may wait out. A filter's factory may answer None: switched off, the pick pays nothing for it.

``scheduling.weights`` picks the scorers by name (not set: each scorer's default weight); ``check`` validates
the names and every plugin's own settings against the registry, with the field path.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any

from pydantic import BaseModel, ValidationError

from extproc.scheduling import backlog, filters, lora_filter, saturation
from extproc.scheduling import scorers as scorers_package
from extproc.scheduling.picker import MaxScore
from extproc.scheduling.plugins import Filter, FilterPlugin, Picker, Scorer, ScorerPlugin
from extproc.scheduling.scheduler import Scheduler
from poolgate.kernel.config import ConfigError, SchedulingSettings

PickerFactory = Callable[[SchedulingSettings, random.Random | None], Picker]

FILTERS: tuple[FilterPlugin[Any], ...] = (
    filters.TENANT_POOLS,
    filters.TASK_CLASS,
    filters.READY_AND_FRESH,
    filters.FITS_CONTEXT,
    filters.GPU_MEMORY,
    filters.KV_FITS,
    lora_filter.PLUGIN,
    saturation.PLUGIN,
    backlog.PLUGIN,
)
PICKERS: Mapping[str, PickerFactory] = MappingProxyType({
    "max_score": lambda s, rng: MaxScore(rng),
})
DEFAULT_PICKER = "max_score"


def scorer_plugins(package: ModuleType = scorers_package) -> tuple[ScorerPlugin[Any], ...]:
    """The ``PLUGIN`` of every module of ``package`` (searched along its ``__path__``), in module-name order; a
    module without one (a helper) is skipped."""
    found = []
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        plugin = getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "PLUGIN", None)
        if isinstance(plugin, ScorerPlugin):
            found.append(plugin)
    return tuple(found)


def _by_name(plugins: Iterable[Any], kind: str) -> Mapping[str, Any]:
    named: dict[str, Any] = {}
    for plugin in plugins:
        if plugin.name in named:
            raise ValueError(f"two {kind}s are named {plugin.name}")
        named[plugin.name] = plugin
    return MappingProxyType(named)


def _problems(exc: ValidationError, path: str) -> list[str]:
    return [f"{path}{''.join(f'.{p}' for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()]


@dataclass(frozen=True, slots=True)
class Registry:
    filters: Mapping[str, FilterPlugin[Any]]
    scorers: Mapping[str, ScorerPlugin[Any]]
    pickers: Mapping[str, PickerFactory]

    @classmethod
    def of(cls, filter_plugins: Iterable[FilterPlugin[Any]], scorer_plugins: Iterable[ScorerPlugin[Any]],
           pickers: Mapping[str, PickerFactory] = PICKERS) -> Registry:
        return cls(_by_name(filter_plugins, "filter"), _by_name(scorer_plugins, "scorer"), pickers)

    def with_scorer(self, plugin: ScorerPlugin[Any]) -> Registry:
        return Registry.of(self.filters.values(), (*self.scorers.values(), plugin), self.pickers)

    @property
    def default_weights(self) -> dict[str, float]:
        return {name: plugin.default_weight for name, plugin in self.scorers.items()}

    def weights(self, settings: SchedulingSettings) -> Mapping[str, float]:
        """The configured weights, or each scorer's default weight where ``scheduling.weights`` is not set."""
        return settings.weights if settings.weights is not None else self.default_weights

    def settings(self, section: Mapping[str, Any]) -> SchedulingSettings:
        """A ``scheduling`` section validated, with its plugins' names and settings, against this registry;
        ConfigError names every problem's field."""
        try:
            settings = SchedulingSettings.model_validate(section)
        except ValidationError as exc:
            raise ConfigError("; ".join(_problems(exc, "scheduling"))) from None
        self.check(settings)
        return settings

    def check(self, settings: SchedulingSettings) -> None:
        """ConfigError, with the field path, for a plugin name the registry does not hold or a plugin's own
        setting it refuses."""
        problems = []
        unknown = sorted(set(settings.weights or {}) - set(self.scorers))
        if unknown:
            problems.append(f"scheduling.weights: unknown scorer {', '.join(unknown)}; known: "
                            f"{', '.join(self.scorers)}")
        for field, plugins, kind in (("scorer_settings", self.scorers, "scorer"),
                                     ("filter_settings", self.filters, "filter")):
            for name, values in getattr(settings, field).items():
                plugin = plugins.get(name)
                if plugin is None:
                    problems.append(f"scheduling.{field}: unknown {kind} {name}; known: {', '.join(plugins)}")
                    continue
                try:
                    plugin.settings.model_validate(values)
                except ValidationError as exc:
                    problems += _problems(exc, f"scheduling.{field}.{name}")
        if problems:
            raise ConfigError("; ".join(problems))

    def _own(self, plugin: ScorerPlugin[Any] | FilterPlugin[Any], given: Mapping[str, Any]) -> BaseModel:
        return plugin.settings.model_validate(given.get(plugin.name) or {})

    def build_filters(self, settings: SchedulingSettings) -> list[Filter]:
        built = (plugin.build(self._own(plugin, settings.filter_settings), settings)
                 for plugin in self.filters.values())
        return [f for f in built if f is not None]

    def build_scorers(self, settings: SchedulingSettings) -> dict[str, Scorer]:
        """Every scorer by its name (weighted or not)."""
        return {name: plugin.build(self._own(plugin, settings.scorer_settings), settings)
                for name, plugin in self.scorers.items()}

    def scheduler(self, settings: SchedulingSettings, rng: random.Random | None = None,
                  picker: str = DEFAULT_PICKER) -> Scheduler:
        """The resource-aware policy: every filter switched on, the configured weighted sum of scorers, the
        picker (its random source breaks ties)."""
        self.check(settings)
        scorers = self.build_scorers(settings)
        weights = self.weights(settings)
        return Scheduler(
            filters=self.build_filters(settings),
            scorers=[(scorers[name], weights.get(name, 0.0)) for name in self.scorers],
            picker=self.pickers[picker](settings, rng),
            explain=settings.debug_header,
            rng=rng,
        )


def discover() -> Registry:
    """The registry the product ships: the filters in their order, every scorer module's declaration."""
    return Registry.of(FILTERS, scorer_plugins())


PLUGINS = discover()


def build_scheduler(settings: SchedulingSettings, rng: random.Random | None = None) -> Scheduler:
    return PLUGINS.scheduler(settings, rng)


def default_scheduler(rng: random.Random | None = None, settings: SchedulingSettings | None = None) -> Scheduler:
    return build_scheduler(settings or SchedulingSettings(), rng)
