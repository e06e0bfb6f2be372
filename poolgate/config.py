"""The one poolgate configuration file: typed, frozen, validated at load.

Errors name the field path (``pools.1.name``) and what to do; a bad value never falls back silently to a
default. Both the controller and extproc read the same file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(Exception):
    """The configuration cannot be used; the message lists every problem with its field path."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Ports(_Frozen):
    """Listening ports. 0 means: pick a free port at start (``poolgate up`` prints what it chose)."""

    envoy: int = Field(8080, ge=0, le=65535)
    envoy_admin: int = Field(0, ge=0, le=65535)
    extproc: int = Field(0, ge=0, le=65535)
    xds: int = Field(0, ge=0, le=65535)
    controller_http: int = Field(0, ge=0, le=65535)


class ExtprocSettings(_Frozen):
    fail_open: bool = True
    """Envoy forwards requests unprocessed to the default route when extproc is down (else 503 JSON)."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Largest request body accepted; Envoy's buffer and grpc's message limit are raised to match."""
    snapshot_refresh_s: float = Field(0.1, gt=0, le=5)
    stale_after_s: float = Field(3.0, gt=0)
    """A worker whose live state is older than this is not picked."""


class ControllerSettings(_Frozen):
    token: str | None = None
    """Shared token for the registration API. Prefer ``token_env``; ``poolgate up`` makes one if neither."""
    token_env: str = "POOLGATE_TOKEN"
    heartbeat_interval_s: float = Field(0.5, gt=0)
    heartbeat_ttl_s: float = Field(1.5, gt=0)
    """A worker that has not sent a heartbeat for this long leaves the registry (and Envoy's endpoints)."""

    @model_validator(mode="after")
    def _ttl_covers_interval(self) -> ControllerSettings:
        if self.heartbeat_ttl_s < 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be at least twice heartbeat_interval_s")
        return self

    def resolved_token(self) -> str | None:
        return self.token or os.environ.get(self.token_env) or None


TaskClass = Literal["short_chat", "long_context", "code_completion", "streaming"]


class TaskClassRules(_Frozen):
    """How a request's task class is decided, first match wins: streaming with a long expected output →
    ``streaming``; prompt ≥ ``long_context_min_tokens`` → ``long_context``; a model in ``code_models`` or a
    ``/v1/completions`` call on one → ``code_completion``; otherwise ``short_chat``."""

    long_context_min_tokens: int = Field(8000, gt=0)
    streaming_min_output_tokens: int = Field(512, gt=0)
    code_models: tuple[str, ...] = ()


class SchedulingSettings(_Frozen):
    """Weights and bounds of the resource-aware picker (extproc)."""

    weights: dict[str, float] = Field(default_factory=lambda: {
        "predicted_ttft": 3.0, "kv_headroom": 2.0, "inflight": 1.0, "prefix_affinity": 1.0})
    """Scorer name → weight; scores are in [0, 1] and combine as a weighted sum."""
    default_prefill_tokens_per_s: float = Field(8000.0, gt=0)
    """Prefill rate assumed for a worker that has not reported one yet."""
    default_output_tokens: int = Field(256, gt=0)
    """Expected output when the request sets no max_tokens and the pool has no history yet."""
    gpu_memory_min_free_mib: float = Field(0.0, ge=0)
    """GPU memory watermark: workers reporting less free memory than this are not picked (0 = off)."""
    kv_reserve_fraction: float = Field(0.02, ge=0, lt=1)
    """KV capacity kept free as a safety margin when checking that a request's footprint fits."""
    tokenizer_path: str | None = None
    """Local model directory with tokenizer files; default is the fast character-based estimate."""
    debug_header: bool = False
    """Add ``x-poolgate-decision`` (worker and scores) to the upstream request and response. Off in production."""
    task_classes: TaskClassRules = TaskClassRules()


class AgentSettings(_Frozen):
    scrape_interval_s: float = Field(0.25, gt=0, le=5)
    """How often the agent reads each worker's /metrics and the GPUs (≤ 0.25 s keeps picks current)."""
    nvml: Literal["auto", "off"] = "auto"
    """``auto``: read GPUs through NVML when a driver is present, else use only the workers' metrics."""


class PoolSpec(_Frozen):
    """A pool is a set of interchangeable workers serving one model; it becomes one Envoy cluster."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    model: str = Field(min_length=1)
    """The served model name clients put in the request's ``model`` field."""
    max_model_len: int = Field(8192, gt=0)
    task_classes: tuple[TaskClass, ...] = ()
    """Task classes this pool takes (empty = all), e.g. ``[streaming]`` for a streaming-only pool."""


class WorkerSpec(_Frozen):
    """One worker process that ``poolgate up`` starts: a simulated vLLM engine or a real ``vllm serve``."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    pool: str
    backend: Literal["sim", "vllm"] = "sim"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    preset: str = "h100-80gb"
    """Simulated GPU preset (``sim`` only)."""
    model_path: str | None = None
    """Hugging Face id or local path (``vllm`` only)."""
    gpus: tuple[int, ...] = ()
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    extra_args: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _backend_fields(self) -> WorkerSpec:
        if self.backend == "vllm" and not self.model_path:
            raise ValueError("backend 'vllm' needs model_path (a Hugging Face id or a local model directory)")
        return self


class Config(_Frozen):
    redis_url: str | None = None
    """Redis to use. When empty, ``poolgate up`` starts its own redis-server on a free port."""
    key_prefix: str = Field("poolgate", pattern=r"^[A-Za-z0-9_.:-]+$")
    ports: Ports = Ports()
    extproc: ExtprocSettings = ExtprocSettings()
    controller: ControllerSettings = ControllerSettings()
    scheduling: SchedulingSettings = SchedulingSettings()
    agent: AgentSettings = AgentSettings()
    pools: tuple[PoolSpec, ...] = Field(min_length=1)
    workers: tuple[WorkerSpec, ...] = ()

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
