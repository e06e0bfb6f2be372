"""The processes' own sections: listening ports, extproc, controller, agent and observability settings."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from poolgate.kernel.config.base import Section


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, bounded by a cgroup v2 CPU quota (a container limited to
    2 CPUs on a 64-core node gets 2, where ``os.cpu_count()`` says 64)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as limits:
            quota, _, period = limits.read().partition(" ")
    except OSError:
        return max(1, cores)
    if quota.strip() == "max" or not period.strip():
        return max(1, cores)
    return max(1, min(cores, -(-int(quota) // int(period))))


class Ports(Section):
    """Listening ports. 0 means: pick a free port at start (``poolgate up`` prints what it chose)."""

    envoy: int = Field(8080, ge=0, le=65535)
    envoy_admin: int = Field(0, ge=0, le=65535)
    extproc: int = Field(0, ge=0, le=65535)
    xds: int = Field(0, ge=0, le=65535)
    controller_http: int = Field(0, ge=0, le=65535)


class KvEventsSettings(Section):
    """Precise prefix-cache knowledge from the workers' KV events (vLLM's ``--kv-events-config``): every extproc
    process subscribes to every serving worker whose record names a ``kv_events_endpoint``."""

    enabled: bool = True
    pending_s: float = Field(2.0, ge=0, le=30)
    """A placed prompt's blocks count as held by its worker for this long, until the events confirm them."""
    max_blocks: int = Field(4_000_000, ge=1)
    """Index bound, in (worker, block) entries over all workers (~290 bytes each)."""
    relearn_s: float = Field(30.0, ge=0)
    """After history that could not be replayed, a worker stays unknown (estimated) this long."""
    replay_timeout_s: float = Field(1.0, gt=0, le=30)
    """How long a replay request may take before the missed batches are given up."""


class ExtprocSettings(Section):
    fail_open: bool = True
    """Envoy forwards requests unprocessed to the default route when extproc is down (else 503 JSON)."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Largest request body accepted; Envoy's buffer and grpc's message limit are raised to match."""
    snapshot_refresh_s: float = Field(0.1, gt=0, le=5)
    stale_after_s: float = Field(3.0, gt=0)
    """A worker whose live state is older than this is not picked."""
    kv_events: KvEventsSettings = KvEventsSettings()
    endpoint_picker_mode: Literal["poolgate", "gie"] = "poolgate"
    """``gie``: also answer the picked ``ip:port`` in the ``x-gateway-destination-endpoint`` request header, for
    gateways that implement the Gateway API Inference Extension endpoint-picker protocol (an ``ORIGINAL_DST``
    cluster reading that header). ``poolgate`` pins through dynamic metadata only, so a header cannot be used
    by a client to pin itself; use ``gie`` only behind a gateway that strips the client's copy first."""
    processes: int = Field(0, ge=0, le=256)
    """extproc processes ``poolgate up`` starts, each on its own port (``ports.extproc`` + i when that port is
    set; the first one's metrics on ``observability.extproc_metrics_port``, the others' on free ports that
    ``extproc.json`` in the run directory lists) as one endpoint of Envoy's ext_proc cluster; 0 means one
    per CPU core. They share in-flight counts and KV reservations through Redis, and tell each other every
    placement at once over local datagrams (``docs/architecture.md``, several processes)."""

    def process_count(self) -> int:
        return self.processes or os.cpu_count() or 1


class ControllerSettings(Section):
    token: str | None = None
    """Shared token for the registration API. Prefer ``token_env``; ``poolgate up`` makes one if neither."""
    token_env: str = "POOLGATE_TOKEN"
    heartbeat_interval_s: float = Field(0.5, gt=0)
    """The shortest interval the registry hands a worker: it answers every registration and heartbeat with
    the interval to use next, this one or longer once the fleet's heartbeats would pass ``max_heartbeats_per_s``
    (``controller/heartbeat_interval.py``)."""
    heartbeat_ttl_s: float = Field(1.5, gt=0)
    """A worker that has not sent a heartbeat for this long leaves the registry (and Envoy's endpoints), at the
    shortest interval; the TTL handed out grows with the interval: the longest interval handed plus
    ``heartbeat_ttl_s − heartbeat_interval_s`` or one interval, whichever is longer."""
    max_heartbeats_per_s: float = Field(1000.0, gt=0)
    """Heartbeat calls a second each registry API process is asked to serve at most: the interval handed to
    the workers stretches so that the whole fleet stays under this rate times ``api_processes`` (Nomad's
    ``max_heartbeats_per_second``). One lean API process serves about 5,000 a core; 1,000 leaves it room for a
    fleet's registrations and the host room for the controller: 10,000 workers on a 2-core machine beat every
    5-6.25 s, and a silent one leaves within 11.25 s by its TTL (the health monitor's probes are sooner)."""
    allowed_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                         "fc00::/7")
    """CIDR blocks a worker registered through the API may have its address in (``host`` must be an IP
    address inside one). The default is loopback and the private ranges (RFC 1918, IPv6 ULA): an address
    outside them, such as a cloud metadata endpoint (169.254.169.254) or a public host, would make Envoy
    send client traffic there. List the blocks your workers live in; ``0.0.0.0/0`` and ``::/0`` allow any."""
    api_processes: int = Field(0, ge=0, le=64)
    """Registry API processes on the API's one port; 0 means one per usable core (the CPU quota of a container).
    They answer the workers' registrations and heartbeats with a lean HTTP server (Linux ``SO_REUSEPORT``: the
    kernel spreads the connections over them) and pass every other call (listing, drain, scale, ``/metrics``)
    to the controller, whose loop never answers a heartbeat: it is left to the health monitor and xDS, where a
    fleet's heartbeats had delayed endpoint changes. The heartbeat budget is ``max_heartbeats_per_s`` times
    this count."""

    def api_process_count(self) -> int:
        return self.api_processes or usable_cores()

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


class ObservabilitySettings(Section):
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
