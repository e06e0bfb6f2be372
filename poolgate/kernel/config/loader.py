"""The whole configuration (``Config``, with the checks across sections) and loading it from YAML."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from poolgate.kernel.config.agent import AgentSettings
from poolgate.kernel.config.base import ConfigError, Section
from poolgate.kernel.config.catalogue import CatalogueSettings
from poolgate.kernel.config.disaggregation import DisaggregationSettings
from poolgate.kernel.config.lifecycle import (
    AutoscaleSettings,
    DrainSettings,
    HealthSettings,
    KubernetesSettings,
    PlacementSettings,
)
from poolgate.kernel.config.pools import PoolSpec, WorkerSpec, has_flag
from poolgate.kernel.config.processes import (
    ControllerSettings,
    ExtprocSettings,
    ObservabilitySettings,
    Ports,
)
from poolgate.kernel.config.scheduling import SchedulingSettings
from poolgate.kernel.config.tenancy import TenancySettings, TenantSpec
from poolgate.kernel.config.transport import TlsSettings
from poolgate.kernel.redis_client import parse_redis_url


class Config(Section):
    redis_url: str | None = None
    """Redis to use: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://host:port[,…]/service[/db]``
    or ``redis+cluster://host:port[,…]``. When empty, ``poolgate up`` starts its own redis-server on a free
    port."""
    key_prefix: str = Field("poolgate", pattern=r"^[A-Za-z0-9_.:-]+$")
    ports: Ports = Ports()
    extproc: ExtprocSettings = ExtprocSettings()
    controller: ControllerSettings = ControllerSettings()
    scheduling: SchedulingSettings = SchedulingSettings()
    agent: AgentSettings = AgentSettings()
    pools: tuple[PoolSpec, ...] = Field(min_length=1)
    workers: tuple[WorkerSpec, ...] = ()
    disaggregation: DisaggregationSettings = DisaggregationSettings()
    health: HealthSettings = HealthSettings()
    drain: DrainSettings = DrainSettings()
    placement: PlacementSettings = PlacementSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    tenancy: TenancySettings = TenancySettings()
    tenants: tuple[TenantSpec, ...] = ()
    catalogue: CatalogueSettings = CatalogueSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    tls: TlsSettings = TlsSettings()
    worker_api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable holding the API key the workers require (vLLM's ``--api-key``). Envoy adds it as
    ``Authorization: Bearer`` to every request it sends a worker (a client's own key never reaches one),
    the controller to its model and adapter calls, and the local backend starts its workers with it (as
    ``VLLM_API_KEY``). Controller, Envoy and ``poolgate up`` need the variable set. Unset: workers need no
    key."""

    def worker_api_key(self) -> str | None:
        """The workers' key, or None when they need none; ConfigError when the variable is named but empty."""
        if self.worker_api_key_env is None:
            return None
        key = os.environ.get(self.worker_api_key_env, "")
        if not key:
            raise ConfigError(f"worker_api_key_env: ${self.worker_api_key_env} is not set; export the workers' "
                              "API key in it, or remove the setting if workers need no key")
        return key

    @field_validator("redis_url")
    @classmethod
    def _redis_url_form(cls, url: str | None) -> str | None:
        if url:
            parse_redis_url(url)  # ValueError names what is wrong; the loader names the field
        return url

    @model_validator(mode="after")
    def _cross_references(self) -> Config:
        pool_names = [p.name for p in self.pools]
        duplicates = sorted({n for n in pool_names if pool_names.count(n) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        worker_ids = [w.id for w in self.workers]
        repeated = sorted({n for n in worker_ids if worker_ids.count(n) > 1})
        if repeated:
            raise ValueError(f"worker ids must be unique; repeated: {', '.join(repeated)}")
        for index, worker in enumerate(self.workers):
            if worker.pool not in pool_names:
                raise ValueError(
                    f"workers.{index}.pool: unknown pool {worker.pool!r}; define it under pools "
                    f"(known: {', '.join(pool_names)})"
                )
        fixed = [w.port for w in self.workers if w.port]
        if len(fixed) != len(set(fixed)):
            raise ValueError("workers: two workers use the same port; give each its own or use 0 (free)")
        for name in self.autoscale.pools:
            if name not in pool_names:
                raise ValueError(f"autoscale.pools.{name}: unknown pool; known: {', '.join(pool_names)}")
        for name in self.placement.model_memory_mib:
            if name not in pool_names:
                raise ValueError(f"placement.model_memory_mib.{name}: unknown pool; known: {', '.join(pool_names)}")
        return self

    @model_validator(mode="after")
    def _pool_tasks(self) -> Config:
        """A model is one kind of model: its pools cannot disagree on what it does."""
        kinds: dict[str, tuple[str, str]] = {}
        for index, pool in enumerate(self.pools):
            first = kinds.setdefault(pool.model, (pool.name, pool.task))
            if first[1] != pool.task:
                raise ValueError(f"pools.{index}.task: {pool.task!r}, but pool {first[0]!r} serves {pool.model!r} "
                                 f"as {first[1]!r}; every pool of a model must give it the same task")
        return self

    @model_validator(mode="after")
    def _pool_roles(self) -> Config:
        """A prefill pool hands its KV to a decode pool of the same model, and only generating models have KV."""
        for index, pool in enumerate(self.pools):
            if pool.role == "both":
                continue
            if pool.task != "generate":
                raise ValueError(f"pools.{index}.role: {pool.role!r} needs task 'generate' (pool {pool.name!r} is "
                                 f"{pool.task!r}); only generation has a prefill and a decode")
            if pool.role == "prefill" and not any(p.model == pool.model and p.role != "prefill" for p in self.pools):
                raise ValueError(f"pools.{index}.role: prefill pool {pool.name!r} has no decode pool; add a pool "
                                 f"of model {pool.model!r} with role 'decode' (or 'both')")
        return self

    @model_validator(mode="after")
    def _local_workers_tls(self) -> Config:
        """With ``tls.workers`` everything reaches workers over HTTPS, so workers this controller starts must
        serve it: from ``tls.local_workers``, or their own ``--ssl-certfile`` in ``extra_args``."""
        if self.tls.workers is None or self.tls.local_workers is not None or self.kubernetes.enabled:
            return self
        launched = [(f"workers.{i}", w.extra_args) for i, w in enumerate(self.workers)]
        launched += [(f"autoscale.pools.{name}.template", s.template.extra_args)
                     for name, s in self.autoscale.pools.items()]
        for field, extra_args in launched:
            if not has_flag(extra_args, "--ssl-certfile"):
                raise ValueError(f"{field}: tls.workers has Envoy and the probes reach workers over HTTPS, but the "
                                 "local backend would start this one serving plain HTTP; set tls.local_workers "
                                 "(the certificate it serves) or give it --ssl-certfile/--ssl-keyfile in extra_args")
        return self

    def disaggregated_models(self) -> frozenset[str]:
        """Models with a prefill pool: their long prompts are split over two workers."""
        return frozenset(p.model for p in self.pools if p.role == "prefill")

    @model_validator(mode="after")
    def _tenant_references(self) -> Config:
        tenancy = self.tenancy
        names = [t.name for t in self.tenants]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(repeated)}")
        if tenancy.require_api_key and not any(t.api_key_sha256 for t in self.tenants):
            raise ValueError("tenancy.require_api_key: no tenant has api_key_sha256; add one with "
                             "`poolgate tenant add NAME`")
        classes = [c.name for c in tenancy.priority_classes]
        pool_names = [p.name for p in self.pools]
        owners: dict[str, str] = {}
        seen_keys: set[str] = set()
        for index, tenant in enumerate(self.tenants):
            if tenant.priority not in classes:
                raise ValueError(f"tenants.{index}.priority: unknown class {tenant.priority!r}; known: "
                                 f"{', '.join(classes)}")
            for pool in tenant.dedicated_pools:
                if pool not in pool_names:
                    raise ValueError(f"tenants.{index}.dedicated_pools: unknown pool {pool!r}")
                if pool in owners:
                    raise ValueError(f"tenants.{index}.dedicated_pools: {pool!r} is already dedicated to "
                                     f"{owners[pool]!r}")
                owners[pool] = tenant.name
            for digest in tenant.api_key_sha256:
                if digest in seen_keys:
                    raise ValueError(f"tenants.{index}.api_key_sha256: a key hash is given to two tenants")
                seen_keys.add(digest)
        return self

    @model_validator(mode="after")
    def _catalogue_references(self) -> Config:
        pools = {p.name: p for p in self.pools}
        served = {p.model for p in self.pools}
        tenants = {t.name for t in self.tenants}
        public: set[str] = set()
        for index, model in enumerate(self.catalogue.models):
            where = f"catalogue.models.{index}"
            for name in (model.name, *model.aliases):
                if name in public:
                    raise ValueError(f"{where}: public name {name!r} is used twice")
                public.add(name)
            for vindex, version in enumerate(model.versions):
                if version.pool is not None:
                    pool = pools.get(version.pool)
                    if pool is None:
                        raise ValueError(f"{where}.versions.{vindex}.pool: unknown pool {version.pool!r}")
                    if pool.model != version.served_name:
                        raise ValueError(f"{where}.versions.{vindex}.pool: pool {pool.name!r} serves "
                                         f"{pool.model!r}, not {version.served_name!r}")
                elif version.served_name not in served:
                    raise ValueError(f"{where}.versions.{vindex}.served_name: no pool serves "
                                     f"{version.served_name!r}; add a pool with that model")
            for rindex, rule in enumerate(model.rules):
                unknown = sorted(set(rule.tenants) - tenants - {self.tenancy.default_tenant})
                if unknown:
                    raise ValueError(f"{where}.rules.{rindex}.tenants: unknown tenant {', '.join(unknown)}")
        return self

    def pool(self, name: str) -> PoolSpec:
        return next(p for p in self.pools if p.name == name)

    def pools_for_model(self, model: str) -> tuple[PoolSpec, ...]:
        return tuple(p for p in self.pools if p.model == model)


def parse_config(data: object, source: str = "<config>") -> Config:
    """Validate already-loaded YAML data; raise ConfigError naming every bad field path."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        lines = []
        for error in errors:
            loc = error["loc"]
            nested = any(len(other["loc"]) > len(loc) and other["loc"][: len(loc)] == loc for other in errors)
            if error["type"] == "too_short" and nested:
                continue  # pydantic's echo of an item that already failed; the item's own error says why
            path = ".".join(str(part) for part in loc)
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"  {path}: {message}" if path else f"  {message}")
        raise ConfigError(f"{source}: invalid configuration\n" + "\n".join(lines)) from None


def load_process_config(path: str | Path, redis_url: str | None, process: str) -> tuple[Config, str]:
    """The config and the Redis URL a long-running process uses (``--redis-url`` wins over the file's);
    ConfigError, naming the process, when either is missing or bad — every such command exits 2 on it."""
    config = load_config(path)
    url = redis_url or config.redis_url
    if not url:
        raise ConfigError(f"{process} needs Redis: pass --redis-url or set redis_url in the configuration")
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ConfigError(f"{process}: --redis-url: {exc}") from None
    return config, url


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config(data, str(path))
