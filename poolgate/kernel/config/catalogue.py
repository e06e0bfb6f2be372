"""The model catalogue: public names, versions, aliases, parameter defaults and caps, LoRA adapters."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from poolgate.kernel.config.base import Section

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,127}$"
ParameterValue = bool | int | float | str


class ModelVersion(Section):
    """One deployable version of a catalogue model: the name the workers serve and its request parameters."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """Version label, e.g. ``v1``; aliases' weights and rules name it."""
    served_name: str = Field(pattern=MODEL_NAME_PATTERN)
    """The model name workers answer to (``pools[].model``); extproc rewrites the request body to it."""
    pool: str | None = None
    """Restrict the version to this pool (its ``model`` must be ``served_name``); default: every pool of it."""
    precision: str | None = None
    """Informational (``bf16``, ``fp8``, …); listed in ``/v1/models``."""
    max_model_len: int | None = Field(None, gt=0)
    """Listed in ``/v1/models``; requests asking for more output than this are refused with 400."""
    defaults: dict[str, ParameterValue] = Field(default_factory=dict)
    """Sampling parameters filled in when the request does not set them, e.g. ``{temperature: 0.7}``."""
    maximums: dict[str, float] = Field(default_factory=dict)
    """Caps on numeric parameters, e.g. ``{max_tokens: 1024}``; a request above one gets a 400 naming it."""

    @field_validator("defaults")
    @classmethod
    def _no_routing_defaults(cls, defaults: dict[str, ParameterValue]) -> dict[str, ParameterValue]:
        reserved = sorted(set(defaults) & {"model", "messages", "prompt", "stream", "stream_options"})
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot have a default (they shape the request, not sampling)")
        return defaults


class AliasRule(Section):
    """Requests of these tenants always get ``version`` (no header needed: the tenant is known already)."""

    tenants: tuple[str, ...] = Field(min_length=1)
    version: str


class CatalogueModel(Section):
    """A public model name with its versions; ``weights`` split traffic (canary), ``rules`` pin tenants."""

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    """The public name clients ask for and see in responses."""
    aliases: tuple[str, ...] = ()
    """Further public names for the same model (resolved, listed and restored the same way)."""
    versions: tuple[ModelVersion, ...] = Field(min_length=1)
    weights: dict[str, float] = Field(default_factory=dict)
    """Version name → relative weight (e.g. ``{v1: 95, v2: 5}``); empty = all traffic to the first version."""
    rules: tuple[AliasRule, ...] = ()
    """Checked in order before the weights; the first rule naming the request's tenant wins."""

    @model_validator(mode="after")
    def _references(self) -> CatalogueModel:
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError("versions: names must be unique")
        for version, weight in self.weights.items():
            if version not in names:
                raise ValueError(f"weights.{version}: unknown version; known: {', '.join(names)}")
            if weight < 0:
                raise ValueError(f"weights.{version}: must be 0 or more")
        if self.weights and sum(self.weights.values()) <= 0:
            raise ValueError("weights: at least one version needs a weight above 0")
        for index, rule in enumerate(self.rules):
            if rule.version not in names:
                raise ValueError(f"rules.{index}.version: unknown version {rule.version!r}; known: {', '.join(names)}")
        return self


class LoraAdapter(Section):
    """A LoRA adapter clients may ask for by ``name`` (as well as ``base:name``); served by ``base``'s workers."""

    name: str = Field(min_length=1, pattern=r"^[^:\s]+$")
    """The adapter's name as vLLM knows it (``lora_name``); no colon, which separates ``base:adapter``."""
    base: str = Field(min_length=1)
    """Served name of the base model whose workers load the adapter."""
    path: str | None = None
    """Where workers load it from (``lora_path``); without one, the controller never loads it (it must be
    preloaded, or found by vLLM's resolver plugin)."""


class CatalogueSettings(Section):
    """The model catalogue (extproc). A pool's ``model`` not named here stays an implicit one-version entry.

    Changes to ``models`` (weights, rules, versions, parameters) take effect without a restart: extproc
    re-reads the file when it changes and keeps the old catalogue if the new file is invalid."""

    models: tuple[CatalogueModel, ...] = ()
    list_served_names: bool = False
    """Also list versions' internal served names in ``/v1/models`` (they stay usable directly either way)."""
    reload_interval_s: float = Field(1.0, gt=0, le=60)
    """How often extproc checks the configuration file for changes."""
    adapters: tuple[LoraAdapter, ...] = ()
    """LoRA adapters asked for by name; ``base:adapter`` works without an entry here."""
    adapter_sync_s: float = Field(5.0, gt=0)
    """How often the controller checks that configured adapters are loaded on their base's workers."""

    @field_validator("adapters")
    @classmethod
    def _unique_adapters(cls, adapters: tuple[LoraAdapter, ...]) -> tuple[LoraAdapter, ...]:
        names = [a.name for a in adapters]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(repeated)}")
        return adapters
