"""The one poolgate configuration file: typed, frozen, validated at load.

Errors name the field path (``pools.1.name``) and what to do; a bad value never falls back silently to a
default. Both the controller and extproc read the same file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from poolgate.kernel.routing import ROUTING_HEADERS


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
    endpoint_picker_mode: Literal["poolgate", "gie"] = "poolgate"
    """``gie``: also answer the picked ``ip:port`` in the ``x-gateway-destination-endpoint`` request header, for
    gateways that implement the Gateway API Inference Extension endpoint-picker protocol (an ``ORIGINAL_DST``
    cluster reading that header). ``poolgate`` pins through dynamic metadata only, so a header cannot be used
    by a client to pin itself; use ``gie`` only behind a gateway that strips the client's copy first."""
    processes: int = Field(0, ge=0, le=256)
    """extproc processes ``poolgate up`` starts, each on its own port (``ports.extproc`` + i when that port is
    set; the first one's metrics on ``observability.extproc_metrics_port``, the others' on free ports that
    ``extproc.json`` in the run directory lists) as one endpoint of Envoy's ext_proc cluster; 0 means one
    per CPU core. They share in-flight counts
    and KV reservations through Redis (``docs/architecture.md``, several processes)."""

    def process_count(self) -> int:
        return self.processes or os.cpu_count() or 1


class ControllerSettings(_Frozen):
    token: str | None = None
    """Shared token for the registration API. Prefer ``token_env``; ``poolgate up`` makes one if neither."""
    token_env: str = "POOLGATE_TOKEN"
    heartbeat_interval_s: float = Field(0.5, gt=0)
    heartbeat_ttl_s: float = Field(1.5, gt=0)
    """A worker that has not sent a heartbeat for this long leaves the registry (and Envoy's endpoints)."""
    allowed_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                         "fc00::/7")
    """CIDR blocks a worker registered through the API may have its address in (``host`` must be an IP
    address inside one). The default is loopback and the private ranges (RFC 1918, IPv6 ULA): an address
    outside them, such as a cloud metadata endpoint (169.254.169.254) or a public host, would make Envoy
    send client traffic there. List the blocks your workers live in; ``0.0.0.0/0`` and ``::/0`` allow any."""

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, networks: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress  # here, not at the top: this field is the module's only use

        for network in networks:
            try:
                ipaddress.ip_network(network, strict=True)
            except ValueError as exc:
                raise ValueError(f"{network!r} is not a CIDR block ({exc}); e.g. 10.0.0.0/8") from None
        return networks

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
    ``streaming``; prompt ≥ ``long_context_min_tokens`` → ``long_context``; a model in ``code_models`` →
    ``code_completion``; otherwise ``short_chat``. Token counts are extproc's estimates."""

    long_context_min_tokens: int = Field(8000, gt=0)
    streaming_min_output_tokens: int = Field(512, gt=0)
    code_models: tuple[str, ...] = ()


DEFAULT_WEIGHTS = {"predicted_ttft": 3.0, "kv_headroom": 2.0, "inflight": 1.0, "prefix_affinity": 1.5,
                   "lora_affinity": 2.0}
SCORER_NAMES = tuple(DEFAULT_WEIGHTS)
"""The scorers extproc's plugin registry ships, by the name ``scheduling.weights`` uses: every process
validates the file at load without importing extproc, and a unit test holds this list to the registry. A
registry extended elsewhere passes its own names as the validation context ``scorer_names``."""
MAX_WAIT_LIMIT_S = 50.0
"""Longest hold allowed: Envoy's ext_proc ``max_message_timeout`` is 60 s and the hold asks for a bit more."""


class SchedulingSettings(_Frozen):
    """Weights and bounds of the resource-aware picker (extproc)."""

    weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    """Scorer name → weight; scores are in [0, 1] and combine as a weighted sum. A missing name weighs 0.
    Affinity outweighs in-flight balance (a cached prefix skips its prefill) but not a longer queue or less KV.
    ``lora_affinity`` scores only requests that name a LoRA adapter (an adapter swap stalls the batch)."""
    default_prefill_tokens_per_s: float = Field(8000.0, gt=0)
    """Prefill rate assumed for a worker that has not reported one yet."""
    default_output_tokens: int = Field(256, gt=0)
    """Expected output when the request sets no max_tokens (reported usage does not feed back into it)."""
    gpu_memory_min_free_mib: float = Field(0.0, ge=0)
    """GPU memory watermark: workers reporting less free memory than this are not picked (0 = off)."""
    kv_reserve_fraction: float = Field(0.02, ge=0, lt=1)
    """KV capacity kept free as a safety margin when checking that a request's footprint fits."""
    tokenizer_path: str | None = None
    """Local model directory with ``tokenizer.json`` (needs the ``tokenizers`` package); default is the fast
    character-based estimate."""
    chars_per_token: float = Field(4.0, gt=0.5, le=16)
    """The fast estimate's characters per prompt token (BPE tokenizers: about 4 on English prose)."""
    debug_header: bool = False
    """Add ``x-poolgate-decision`` (worker, task class, token estimates and scores) to the upstream request.
    Off in production: it tells the worker how it was chosen."""
    max_wait_s: float = Field(5.0, ge=0, le=MAX_WAIT_LIMIT_S)
    """How long a request that fits on no worker now is held, re-picking as capacity frees, before the answer
    is 429 with Retry-After (0 = answer at once)."""
    retry_after_s: int = Field(1, ge=1, le=3600)
    """The Retry-After sent with a 503 (no ready worker) or a 429 (no capacity)."""
    ttft_reference_s: float = Field(0.5, gt=0)
    """Predicted time to first token that scores 0.5 (score = t_ref / (t_ref + t))."""
    reservation_settle_s: float = Field(0.5, ge=0)
    """A placement counts as seen by the agent once the worker's record is this much newer than it."""
    prefix_chunk_chars: int = Field(256, ge=16)
    """Prompt-prefix affinity hashes the prompt in chunks of this many characters."""
    prefix_max_chunks: int = Field(32, ge=1, le=1024)
    """Only the first this many chunks of a prompt count for affinity (bounds the hashing per request)."""
    affinity_max_entries: int = Field(50_000, ge=0)
    """Size of the affinity map (session or prefix → worker), least recently used out first (0 = off)."""
    task_classes: TaskClassRules = TaskClassRules()
    max_inflight_per_worker: int = Field(0, ge=0)
    """Saturation gate: a worker whose load, max(running + waiting, extproc's in-flight), reaches this takes no
    more requests; they wait in the priority queue, served class by class (0 = off)."""
    lower_class_inflight_fraction: float = Field(1.0, gt=0, le=1)
    """Classes below the highest may fill a worker only to this fraction of ``max_inflight_per_worker``; the
    rest is headroom the highest class finds free when lower classes burst (1 = no headroom)."""
    queue_when_waiting: bool = False
    """Classes below the highest are not placed on a worker whose engine reports waiting requests (it is full:
    they would queue there, out of priority order)."""

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, weights: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        known = tuple((info.context or {}).get("scorer_names", SCORER_NAMES))
        unknown = sorted(set(weights) - set(known))
        if unknown:
            raise ValueError(f"unknown scorer {', '.join(unknown)}; known: {', '.join(known)}")
        negative = sorted(name for name, weight in weights.items() if weight < 0)
        if negative:
            raise ValueError(f"{', '.join(negative)} must be 0 or more")
        return weights


_LABEL_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*'


def _http_url(url: str) -> str:
    from urllib.parse import urlsplit  # here, not at the top: the GPU sources are its only users

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return url


class DcgmExporterSettings(_Frozen):
    """This node's NVIDIA dcgm-exporter, read by the agent when ``agent.gpu_source`` is ``dcgm``."""

    url: str = "http://127.0.0.1:9400/metrics"
    """The exporter's ``/metrics`` page on this node. On Kubernetes: the node's address and the exporter's
    hostPort, or a Service with ``internalTrafficPolicy: Local`` (docs/gpu-workers.md)."""
    timeout_s: float = Field(1.0, gt=0, le=30)
    interval_s: float = Field(1.0, gt=0, le=300)
    """Seconds between reads of the page (dcgm-exporter samples every 30 s unless started with ``-c MS``)."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)


class PrometheusGpuSettings(_Frozen):
    """A Prometheus server that scrapes dcgm-exporter, queried when ``agent.gpu_source`` is ``prometheus``:
    one query per read for every GPU it knows."""

    url: str = ""
    """The server's base URL, e.g. ``http://prometheus.monitoring:9090`` (``/api/v1/query`` is added)."""
    selector: str = ""
    """Extra label matchers for the query, e.g. ``job="dcgm-exporter"`` (PromQL syntax, comma-separated)."""
    node_label: str = "Hostname"
    """The label that names a GPU's node, matched against the worker's ``node`` (dcgm-exporter's own)."""
    timeout_s: float = Field(2.0, gt=0, le=30)
    interval_s: float = Field(5.0, gt=0, le=300)
    """Seconds between queries; below Prometheus's scrape interval for the exporter nothing new is learned."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url) if url else url

    @field_validator("selector")
    @classmethod
    def _matchers(cls, selector: str) -> str:
        import re  # here, not at the top: this field is the module's only use

        if selector.strip() and not re.fullmatch(f"{_LABEL_MATCHER}(,{_LABEL_MATCHER})*,?\\s*", selector):
            raise ValueError(f"{selector!r} is not a list of PromQL label matchers, e.g. job=\"dcgm-exporter\"")
        return selector


class AgentSettings(_Frozen):
    scrape_interval_s: float = Field(0.25, gt=0, le=5)
    """How often the agent reads each worker's /metrics and the GPUs (≤ 0.25 s keeps picks current)."""
    nvml: Literal["auto", "off"] = "auto"
    """``auto``: read GPUs through NVML when a driver is present, else use only the workers' metrics."""
    gpu_source: Literal["nvml", "dcgm", "prometheus"] = "nvml"
    """Where GPU memory and utilisation come from: NVML on the node (``nvml`` setting above), this node's
    dcgm-exporter (``dcgm``), or a Prometheus server that scrapes the exporters (``prometheus``)."""
    dcgm: DcgmExporterSettings = DcgmExporterSettings()
    prometheus: PrometheusGpuSettings = PrometheusGpuSettings()

    @model_validator(mode="after")
    def _prometheus_has_url(self) -> AgentSettings:
        if self.gpu_source == "prometheus" and not self.prometheus.url:
            raise ValueError("gpu_source prometheus needs prometheus.url, e.g. http://prometheus:9090")
        return self



class HealthSettings(_Frozen):
    """The controller's health monitor: active probes of every registered worker plus passive failure reports.

    A worker turns Failed after ``failures_to_fail`` bad probes in a row (or ``passive_failures_to_fail``
    failures reported by the data path within one probe interval) and Ready again after
    ``successes_to_ready`` good ones; Busy while saturated. One bad probe never ejects a worker."""

    probe_interval_s: float = Field(0.5, gt=0, le=30)
    probe_timeout_s: float = Field(1.0, gt=0, le=30)
    """A probe slower than this is a failure: a hung worker fails its probes, it does not block them."""
    check_models: bool = True
    """Also ``GET /v1/models`` and require the pool's model in it (catches a worker serving the wrong model)."""
    slow_probe_s: float = Field(0.0, ge=0)
    """Probe latency above this counts as a failure (0 = off; the timeout still applies)."""
    failures_to_fail: int = Field(3, ge=1)
    successes_to_ready: int = Field(2, ge=1)
    passive_failures_to_fail: int = Field(3, ge=1)
    """Data-path failures (5xx, timeouts, resets) reported through Redis within one probe interval that make
    a worker Failed at once, without waiting for probes."""
    busy_kv_usage: float = Field(0.95, gt=0, le=1)
    """A worker with requests waiting and KV usage at or above this is Busy (not picked) until it clears."""
    replace_failed_after_s: float = Field(5.0, gt=0)
    """A worker the controller runs that stays Failed this long is restarted (a hung engine never recovers)."""
    kv_leak_usage: float = Field(0.9, gt=0, le=1)
    kv_leak_after_s: float = Field(5.0, gt=0)
    """KV usage at or above ``kv_leak_usage`` with nothing running or waiting for this long is a KV leak: the
    worker is drained and replaced."""

    @model_validator(mode="after")
    def _timeout_fits_interval(self) -> HealthSettings:
        if self.probe_timeout_s > 10 * self.probe_interval_s:
            raise ValueError("probe_timeout_s must be at most 10 × probe_interval_s")
        return self


class DrainSettings(_Frozen):
    """How a worker leaves: Draining (Envoy DRAINING, extproc stops choosing it) → in-flight 0 → stop."""

    grace_s: float = Field(60.0, gt=0)
    """Longest wait for in-flight requests and streams; the worker stops when it ends even if some remain."""
    poll_s: float = Field(0.25, gt=0, le=5)
    settle_s: float = Field(1.0, ge=0)
    """Minimum time in Draining before stopping, so every extproc replica has seen the state change."""


class PlacementSettings(_Frozen):
    """GPU-aware placement of new ``vllm`` workers on this node."""

    model_memory_mib: dict[str, float] = Field(default_factory=dict)
    """Pool name → GPU memory one worker of it needs (weights + KV budget), per GPU."""
    default_memory_mib: float = Field(0.0, ge=0)
    """Need assumed for a pool not listed above (0 = any GPU fits)."""


class WorkerTemplate(_Frozen):
    """What a worker added by the autoscaler or ``poolgate scale`` looks like (ids are ``{pool}-{n}``)."""

    backend: Literal["sim", "vllm"] = "sim"
    host: str = "127.0.0.1"
    preset: str = "h100-80gb"
    model_path: str | None = None
    gpu_count: int = Field(1, ge=0, le=64)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    extra_args: tuple[str, ...] = ()


class PoolScaling(_Frozen):
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(4, ge=1)
    template: WorkerTemplate = WorkerTemplate()

    @model_validator(mode="after")
    def _min_below_max(self) -> PoolScaling:
        if self.min_workers > self.max_workers:
            raise ValueError("min_workers must not exceed max_workers")
        return self


class AutoscaleSettings(_Frozen):
    """Per-pool autoscaling over a short metrics history; every decision is logged and counted."""

    enabled: bool = False
    interval_s: float = Field(1.0, gt=0, le=60)
    pools: dict[str, PoolScaling] = Field(default_factory=dict)
    """Pool name → bounds and worker template; pools not listed are not scaled (nor by ``poolgate scale``)."""
    up_waiting_per_worker: float = Field(2.0, gt=0)
    """Scale up when requests waiting (engine queues + extproc queue) per worker stay above this …"""
    up_kv_usage: float = Field(0.85, gt=0, le=1)
    """… or the pool's mean KV usage stays above this …"""
    up_ttft_s: float = Field(0.0, ge=0)
    """… or the pool's observed time to first token (mean of its ready workers' TTFT EWMA, while requests
    are in flight) stays above this many seconds (0 = off; a worker leaves only at half of it or less) …"""
    up_sustain_s: float = Field(3.0, ge=0)
    """… for this long."""
    up_step: int = Field(1, ge=1)
    down_running_per_worker: float = Field(4.0, ge=0)
    """Scale down (through a drain) when nothing waits and the pool's running requests, spread over one
    worker fewer, stay at or below this per worker for ``down_cooldown_s``."""
    down_cooldown_s: float = Field(20.0, ge=0)
    """Quiet time needed, after any scale event and of idleness, before removing a worker."""
    lease_ttl_s: float = Field(5.0, gt=0)
    """Leader lease in Redis: only the holder scales, drains and replaces."""


class KubernetesSettings(_Frozen):
    """The Kubernetes backend scales one Deployment per pool (``{deployment_prefix}{pool}``)."""

    enabled: bool = False
    """Run workers as Kubernetes pods (in-cluster service account or kubeconfig) instead of local processes."""
    namespace: str = "poolgate"
    deployment_prefix: str = "poolgate-worker-"


class PoolSpec(_Frozen):
    """A pool is a set of interchangeable workers serving one model; it becomes one Envoy cluster."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    model: str = Field(min_length=1)
    """The served model name clients put in the request's ``model`` field."""
    max_model_len: int = Field(8192, gt=0)
    task_classes: tuple[TaskClass, ...] = ()
    """Task classes this pool takes (empty = all), e.g. ``[streaming]`` for a streaming-only pool. When no
    pool of a model takes a request's class, every pool of the model may serve it."""


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


PRIORITY_CLASS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"


class PriorityClass(_Frozen):
    """One class of the priority queue; classes are served in strict order (the first listed goes first)."""

    name: str = Field(pattern=PRIORITY_CLASS_PATTERN)
    max_wait_s: float | None = Field(None, ge=0, le=MAX_WAIT_LIMIT_S)
    """Longest a request of this class waits for capacity before 429 (default: ``scheduling.max_wait_s``)."""


class TenantSpec(_Frozen):
    """One tenant: who it is (API key hashes), what it may use, and its limits (absent = unlimited)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    api_key_sha256: tuple[str, ...] = ()
    """Hex SHA-256 of each API key (``poolgate tenant add`` prints a new key and this hash); keys are never stored."""
    models: tuple[str, ...] = ()
    """Models the tenant may ask for (empty = every model); any other answers 403."""
    priority: str = Field("standard", pattern=PRIORITY_CLASS_PATTERN)
    """Name of a ``tenancy.priority_classes`` entry."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Share of its class's capacity (by tokens) against other backlogged tenants of the class."""
    max_concurrent: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    """Prompt estimate plus expected output, reserved at admission and reconciled with the real usage."""
    dedicated_pools: tuple[str, ...] = ()
    """Pools only this tenant may use; the tenant then runs only there unless ``dedicated_only`` is false."""
    dedicated_only: bool = True

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, hashes: tuple[str, ...]) -> tuple[str, ...]:
        bad = [h for h in hashes if len(h) != 64 or any(c not in "0123456789abcdef" for c in h)]
        if bad:
            raise ValueError("each entry must be 64 lower-case hex characters (a SHA-256 digest); "
                             "`poolgate tenant add NAME` prints one")
        return hashes

    @property
    def has_quota(self) -> bool:
        return any(v is not None for v in (self.max_concurrent, self.requests_per_minute, self.tokens_per_minute))


class TenancySettings(_Frozen):
    """Identity, admission and the priority queue (extproc). With no tenants configured every request
    belongs to the implicit ``default_tenant`` (open access, no quotas)."""

    require_api_key: bool = False
    """Requests must carry ``Authorization: Bearer <key>`` of a configured tenant (else 401)."""
    tenant_header: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    """Header naming the tenant, set by an ingress in front of Envoy. Read only when ``trust_tenant_header``;
    otherwise a client-sent copy is stripped and ignored. Must not be a poolgate routing header (Envoy
    strips those before anything reads them)."""
    trust_tenant_header: bool = False
    default_tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """Tenant of requests without a key when keys are not required (a configured tenant or an open one)."""
    priority_classes: tuple[PriorityClass, ...] = (
        PriorityClass(name="high"), PriorityClass(name="standard"), PriorityClass(name="low"))
    """Highest first."""
    max_queued: int = Field(1000, ge=0)
    """Requests held for capacity at once (per extproc process); on overflow the lowest class is shed."""
    quota_fail_open: bool = True
    """Admit when Redis cannot be asked (degraded: shows in ``poolgate_extproc_quota_errors``), else 503."""
    reconcile_usage: bool = True
    """Watch response bodies of tenants with a tokens-per-minute limit to charge their real usage (costs
    extproc CPU per response chunk); streaming requests get ``stream_options.include_usage`` injected and
    the extra chunk hidden from clients that did not ask for it."""
    lease_s: float = Field(900.0, gt=0)
    """A concurrency slot not released by then (its extproc died) stops counting."""

    @model_validator(mode="after")
    def _classes(self) -> TenancySettings:
        names = [c.name for c in self.priority_classes]
        if not names:
            raise ValueError("priority_classes: at least one class is needed")
        if len(set(names)) != len(names):
            raise ValueError("priority_classes: names must be unique")
        if self.trust_tenant_header and not self.tenant_header:
            raise ValueError("trust_tenant_header needs tenant_header (the header the ingress sets)")
        if self.tenant_header in ROUTING_HEADERS:
            raise ValueError(f"tenant_header: {self.tenant_header} is removed by Envoy before extproc sees it; "
                             "use another name, e.g. x-tenant-id")
        return self


MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,127}$"
ParameterValue = bool | int | float | str


class ModelVersion(_Frozen):
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


class AliasRule(_Frozen):
    """Requests of these tenants always get ``version`` (no header needed: the tenant is known already)."""

    tenants: tuple[str, ...] = Field(min_length=1)
    version: str


class CatalogueModel(_Frozen):
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


class LoraAdapter(_Frozen):
    """A LoRA adapter clients may ask for by ``name`` (as well as ``base:name``); served by ``base``'s workers."""

    name: str = Field(min_length=1, pattern=r"^[^:\s]+$")
    """The adapter's name as vLLM knows it (``lora_name``); no colon, which separates ``base:adapter``."""
    base: str = Field(min_length=1)
    """Served name of the base model whose workers load the adapter."""
    path: str | None = None
    """Where workers load it from (``lora_path``); without one, the controller never loads it (it must be
    preloaded, or found by vLLM's resolver plugin)."""


class CatalogueSettings(_Frozen):
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


class ObservabilitySettings(_Frozen):
    """What extproc measures beyond its own decisions, and where it shows it."""

    genai_metrics: bool = False
    """Export the OpenTelemetry GenAI metrics (token usage, time to first token, time per output token,
    request duration; see docs/metrics.md). Every inference response then passes through extproc, its status
    and its body chunk by chunk: one ext_proc message per streamed chunk, paid in extproc CPU (tens of µs
    each) and a little latency per chunk; streaming requests get ``stream_options.include_usage`` injected,
    with the extra usage chunk hidden from clients that did not ask for it. Responses extproc watches anyway
    (tenants with a tokens-per-minute limit) cost nothing more."""
    extproc_metrics_port: int | None = Field(None, ge=1, le=65535)
    """extproc serves Prometheus ``/metrics`` on this port (``poolgate up`` included); ``poolgate extproc
    --metrics-port`` wins over it. Unset: no metrics endpoint unless the flag is given."""


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
    health: HealthSettings = HealthSettings()
    drain: DrainSettings = DrainSettings()
    placement: PlacementSettings = PlacementSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    tenancy: TenancySettings = TenancySettings()
    tenants: tuple[TenantSpec, ...] = ()
    catalogue: CatalogueSettings = CatalogueSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
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
