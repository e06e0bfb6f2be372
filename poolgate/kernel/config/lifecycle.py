"""The fleet lifecycle's sections (controller): health, drain, GPU placement, autoscaling, Kubernetes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from poolgate.kernel.config.base import Section
from poolgate.kernel.config.worker_launch import check_cpu_worker, check_kv_events_args

MAX_COLD_START_WAIT_S = 290.0
"""Longest cold-start wait allowed: Envoy's ext_proc ``max_message_timeout`` is 300 s and the hold asks for a bit
more than the wait."""


class HealthSettings(Section):
    """The controller's health monitor: active probes of every registered worker plus passive failure reports.

    A worker turns Failed after ``failures_to_fail`` bad probes in a row (or ``passive_failures_to_fail``
    failures reported by the data path within ``passive_window_s``) and Ready again after
    ``successes_to_ready`` good ones; Busy while saturated. One bad probe never ejects a worker."""

    probe_interval_s: float = Field(0.5, gt=0, le=30)
    probe_timeout_s: float = Field(1.0, gt=0, le=30)
    """A probe slower than this is a failure: a hung worker fails its probes, it does not block them."""
    check_models: bool = True
    """Also ``GET /v1/models`` and require the pool's model in it (catches a worker serving the wrong model)."""
    slow_probe_s: float = Field(0.0, ge=0)
    """Probe latency above this counts as a failure (0 = off; the timeout still applies)."""
    max_probes_per_s: float = Field(5000.0, gt=0)
    """A round starts at most this many probes a second: past ``max_probes_per_s × probe_interval_s / 2``
    workers a round takes longer than the interval. A worker that hangs is Failed once its next probe and the
    ``failures_to_fail - 1`` that confirm it, started half an interval apart while the first is still out, have
    timed out (1.5 s at the defaults); that probe comes up to a round later: at 10,000 workers a round takes
    2 s at the default, so 1,000 workers that hang at once leave within about 4.5 s (a round, 0.4 s for their
    first probes to take and give back the round's slots, 1.5 s of probes, a write period and the push). Each
    probe is one kept-alive HTTP request, ~100 µs of the controller's CPU: the default holds the monitor to about
    half a core however large the fleet (at 8,000 a second it took 0.8 of a core at 10,000 workers, which with the
    registry API's share passed the one core a 10,000-worker controller is meant to take)."""
    failures_to_fail: int = Field(3, ge=1)
    successes_to_ready: int = Field(2, ge=1)
    passive_failures_to_fail: int = Field(3, ge=1)
    """Data-path failures within ``passive_window_s`` (5xx, timeouts, resets: every Envoy reports its failed
    upstream attempts to the controllers) that make a worker Failed at once: the monitor reads them every 0.25 s
    and fails such a worker out of turn, whatever its round and its probes. The failures it was failed on count
    no more."""
    passive_window_s: float = Field(10.0, gt=0)
    """How far back data-path failures count: a worker that fails every request it gets leaves once it got
    ``passive_failures_to_fail`` within this long, however few requests reach it; one that fails rarely
    (fewer than that many within it) stays."""
    passive_hold_s: float = Field(5.0, ge=0)
    """A worker failed on data-path failures stays Failed at least this long, whatever its probes say; each
    such ejection in a row doubles it (a worker that fails its requests but answers its probes would
    otherwise be back, and failing requests, within a second). Starts over once the worker has served as long
    as its last hold."""
    passive_hold_max_s: float = Field(300.0, ge=0)
    """The longest such hold."""
    busy_kv_usage: float = Field(0.95, gt=0, le=1)
    """A worker with requests waiting and KV usage at or above this is Busy (not picked) until it clears;
    requests for a model whose workers are all Busy wait in extproc's queue (up to ``scheduling.max_wait_s``)."""
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


class DrainSettings(Section):
    """How a worker leaves: Draining (Envoy DRAINING, extproc stops choosing it) → in-flight 0 → stop."""

    grace_s: float = Field(60.0, gt=0)
    """Longest wait for in-flight requests and streams; the worker stops when it ends even if some remain."""
    poll_s: float = Field(0.25, gt=0, le=5)
    settle_s: float = Field(1.0, ge=0)
    """Minimum time in Draining before stopping, so every extproc replica has seen the state change."""


class PlacementSettings(Section):
    """GPU-aware placement of new ``vllm`` workers on this node."""

    model_memory_mib: dict[str, float] = Field(default_factory=dict)
    """Pool name → GPU memory one worker of it needs (weights + KV budget), per GPU."""
    default_memory_mib: float = Field(0.0, ge=0)
    """Need assumed for a pool not listed above (0 = any GPU fits)."""


class WorkerTemplate(Section):
    """What a worker added by the autoscaler or ``poolgate scale`` looks like (ids are ``{pool}-{n}``)."""

    backend: Literal["sim", "vllm"] = "sim"
    host: str = "127.0.0.1"
    preset: str = "h100-80gb"
    model_path: str | None = None
    gpu_count: int = Field(1, ge=0, le=64)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_gib: int | None = Field(None, gt=0)
    """KV cache in GiB for ``vllm`` workers on CPU (as ``workers[].kv_cache_gib``): they get no GPUs
    (``gpu_count`` and ``gpu_memory_utilization`` are not used)."""
    extra_args: tuple[str, ...] = ()

    @field_validator("kv_cache_gib")
    @classmethod
    def _cpu_worker(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            check_cpu_worker(info.data.get("backend"), ())
        return value

    @field_validator("extra_args")
    @classmethod
    def _kv_events_bind(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_kv_events_args(value)
        return value


class PoolScaling(Section):
    min_workers: int = Field(1, ge=0)
    """0 lets the pool scale to zero (with ``autoscale.enabled``): a request for it then waits for a cold start."""
    max_workers: int = Field(4, ge=1)
    template: WorkerTemplate = WorkerTemplate()
    sleep_level: Literal[0, 1, 2] = 0
    """How the autoscaler gives back a worker it no longer needs: 0 stops the process (after a drain); 1 or 2
    puts its engine to sleep at that level (vLLM's sleep mode, ``POST /sleep?level=N``: 1 offloads the weights
    to CPU memory, 2 discards them) and wakes it (``POST /wake_up``) before starting a new one. Only for
    engines that support it (vLLM started with ``--enable-sleep-mode``, a CUDA build; the simulated worker).
    Sleeping workers count toward ``max_workers``."""
    standby_workers: int = Field(0, ge=0)
    """With ``sleep_level``: sleeping workers the pool keeps beside its awake ones, launched ahead of need and put
    to sleep once they serve, so that a rise wakes a worker in seconds instead of waiting for a start (a vLLM
    start with real weights takes minutes). Awake and sleeping together stay within ``max_workers``; a spare that
    is woken is replaced by a new launch while there is room. On Kubernetes (pods named by their Deployment) the
    spares are launched once and sleep as the autoscaler's surplus; a pool one of whose engines refused to sleep
    keeps none."""
    cold_start_wait_s: float = Field(120.0, gt=0, le=MAX_COLD_START_WAIT_S)
    """With ``min_workers: 0``: how long a request for the empty pool waits in extproc's queue while the
    controller starts a worker (a vLLM start, model load included, takes from seconds to minutes), before a
    503 with Retry-After. Pools that cannot scale to zero answer 503 at once when no worker is ready."""

    @model_validator(mode="after")
    def _min_below_max(self) -> PoolScaling:
        if self.min_workers > self.max_workers:
            raise ValueError("min_workers must not exceed max_workers")
        if self.sleep_level and "--enable-sleep-mode" not in self.template.extra_args:
            raise ValueError("sleep_level needs engines that can sleep: add --enable-sleep-mode to "
                             "template.extra_args (a vLLM worker also needs VLLM_SERVER_DEV_MODE=1 in its environment)")
        if self.standby_workers and not self.sleep_level:
            raise ValueError("standby_workers are kept asleep: set sleep_level (1 or 2) as well")
        if self.standby_workers >= self.max_workers:
            raise ValueError("standby_workers must leave room for an awake worker: fewer than max_workers")
        return self


class AutoscaleSettings(Section):
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
    worker_capacity: float = Field(0.0, ge=0)
    """Requests (in flight plus queued in extproc) one worker carries while its time to first token stays
    within the SLO. Set, it turns on capacity planning (``controller.autoscale_plan``): the pool is sized for
    its demand at now + start-up time, and a worker leaves only once the demand of the last start-up time
    (wake-up time when it goes to sleep) would fit without it. 0 = off: the pressure rules above alone."""
    startup_s: float = Field(30.0, gt=0)
    """A new worker's start-up time (launch to serving) until the pool's own launches have measured it."""
    wake_s: float = Field(2.0, gt=0)
    """A sleeping worker's wake-up time until the pool's own wake-ups have measured it."""
    demand_window_s: float = Field(5.0, gt=0)
    """Demand is the mean over this long (the instantaneous count of a few requests is mostly noise)."""
    trend_window_s: float = Field(30.0, gt=0)
    """The demand's trend is its least-squares slope over this long."""
    lease_ttl_s: float = Field(5.0, gt=0)
    """Leader lease in Redis: only the holder scales, drains and replaces."""


class KubernetesSettings(Section):
    """The Kubernetes backend scales one Deployment per pool (``{deployment_prefix}{pool}``)."""

    enabled: bool = False
    """Run workers as Kubernetes pods (in-cluster service account or kubeconfig) instead of local processes."""
    namespace: str = "poolgate"
    deployment_prefix: str = "poolgate-worker-"
