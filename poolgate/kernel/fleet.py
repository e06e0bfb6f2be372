"""The fleet schema: what one worker's record holds, and how its fields read and write as Redis strings.

A record has identity facts (pool, model, address, node, limits), written at registration, and live facts
(``LIVE_FIELDS``: state and the engine and GPU facts the agent reads), written with heartbeats. Where the
record lives in Redis, and every read and write of it, is ``poolgate.kernel.store``'s business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import orjson


class WorkerState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    BUSY = "Busy"
    DRAINING = "Draining"
    FAILED = "Failed"


@dataclass(frozen=True)
class WorkerRecord:
    """What the fleet knows about one worker. Static facts come at registration, live ones with heartbeats."""

    id: str
    pool: str
    model: str
    host: str
    port: int
    served_names: tuple[str, ...] = ()
    max_model_len: int = 8192
    backend: str = "sim"
    node: str = ""
    """The node (machine) the worker runs on, for the agent of that node; "" = not known (registered by an
    older writer, or by a registrant that did not say). On Kubernetes: the pod's ``spec.nodeName``."""
    state: WorkerState = WorkerState.READY
    kv_capacity_tokens: int = 0
    """KV cache size in tokens (num_gpu_blocks × block_size); 0 = not reported yet."""
    kv_block_size: int = 16
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    ttft_ewma_s: float = -1.0
    """Recent time to first token (moving average of the worker's histogram deltas); -1 = unknown."""
    prefill_tokens_per_s: float = 0.0
    """Observed prompt throughput while busy; 0 = unknown (the scheduler then uses its configured default)."""
    inter_token_s: float = -1.0
    """Recent mean time between a stream's tokens (vLLM's inter-token latency histogram): how fast the running
    streams grow their KV; -1 = unknown."""
    gpu_memory_total_mib: float = -1.0
    gpu_memory_free_mib: float = -1.0
    gpu_utilization: float = -1.0
    """0..1 across the worker's GPUs; -1 = unknown (no NVML and no simulated GPU)."""
    sleep_level: int = 0
    """vLLM's sleep mode (``vllm:engine_sleep_state``): 0 awake (or not reported), 1 weights offloaded, 2 weights
    and KV cache discarded. A sleeping engine answers ``/health`` and looks idle, but extproc routes nothing to it
    until it wakes (the ``ready_and_fresh`` filter)."""
    prefix_cache_hit_rate: float = -1.0
    """Share of looked-up prompt tokens the engine's prefix cache held, recently (``vllm:prefix_cache_hits_total``
    over ``…_queries_total``, a moving average of scrape intervals); -1 = unknown."""
    waiting_deferred: int = 0
    """Of ``waiting``, requests held back by a transient constraint (LoRA budget, KV transfer) rather than by
    capacity (``vllm:num_requests_waiting_by_reason``)."""
    updated_at: float = field(default_factory=time.time)
    """Last liveness report (registration or heartbeat)."""
    metrics_at: float = 0.0
    """When the agent last read this worker's metrics and GPUs; 0 = never. Live facts older than the
    staleness bound must not be trusted for placement even while the worker still heartbeats."""
    registered_at: float = 0.0
    """When this registration was written (set by ``FleetStore.register``): tells a restarted worker from the
    same worker seen again."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters with requests running or waiting on the worker (``vllm:lora_requests_info``)."""
    max_loras: int = 0
    """Adapters the worker can hold at once (``max_lora`` label); 0 = LoRA not enabled or not reported."""
    kv_events_endpoint: str = ""
    """Where the engine publishes its KV-cache events (vLLM's ``--kv-events-config`` endpoint, as a subscriber
    connects to it, e.g. ``tcp://10.0.0.5:5557``); "" = it publishes none, and the router estimates."""
    kv_events_replay_endpoint: str = ""
    """Its replay socket (``replay_endpoint``), for catching up after a gap; "" = none."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_names or (self.model,)

    def to_redis(self) -> dict[str, str]:
        return encode_fields({name: getattr(self, name) for name in _FIELD_NAMES})

    @classmethod
    def from_redis(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> WorkerRecord:
        """The record a Redis hash holds (bytes or text); fields it lacks take their defaults, others are
        ignored. Each field is read by its own decoder, looked up by the field's name (``_DECODERS``). A full
        read of 10,000 workers (a reader's first, and one every resync) took ~0.7 s of its loop's CPU, most of
        it here while each call walked the dataclass's fields and compared type names; this takes half as long."""
        values = dict(_DEFAULTS)
        for key, value in raw.items():
            decoder = _DECODERS.get(key)
            if decoder is not None:
                values[decoder[0]] = decoder[1](value)
        if cls is not WorkerRecord or len(values) < len(_FIELD_NAMES):  # (the constructor says what is missing)
            return cls(**{name: value for name, value in values.items() if value is not _FROM_FACTORY})
        for name, factory in _FACTORIES:
            if values[name] is _FROM_FACTORY:
                values[name] = factory()
        # The generated __init__ sets the 32 fields of a frozen dataclass one ``object.__setattr__`` at a time:
        # half of this call. It checks nothing more, so the decoded values go straight in.
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    def with_live(self, **live: Any) -> WorkerRecord:
        return replace(self, **live)


AGENT_FACTS = ("kv_capacity_tokens", "kv_usage", "running", "waiting", "preemptions_total", "ttft_ewma_s",
               "prefill_tokens_per_s", "inter_token_s", "gpu_memory_total_mib", "gpu_memory_free_mib",
               "gpu_utilization", "sleep_level", "prefix_cache_hit_rate", "waiting_deferred")
"""The agent's observations that lose their meaning with age: readers reset them to ``UNKNOWN_AGENT_FACTS``
when ``metrics_at`` is older than their staleness bound."""
UNKNOWN_AGENT_FACTS: Mapping[str, Any] = MappingProxyType(
    {name: WorkerRecord.__dataclass_fields__[name].default for name in AGENT_FACTS})
_FIELD_NAMES = tuple(f.name for f in fields(WorkerRecord))
"""Field names in order, once (``dataclasses.asdict`` deep-copies and cost a registration more than Redis)."""

LIVE_FIELDS = ("state", *AGENT_FACTS, "kv_block_size", "lora_adapters", "max_loras", "updated_at", "metrics_at")
"""Fields that heartbeats and the agent rewrite; every other field is identity, written at registration."""


def encode_fields(values: Mapping[str, Any]) -> dict[str, str]:
    """Field values as Redis strings: sequences as JSON lists, everything else as ``str``."""
    return {key: orjson.dumps(list(value)).decode() if isinstance(value, tuple | list) else str(value)
            for key, value in values.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


_STATES: Mapping[bytes | str, WorkerState] = MappingProxyType(
    {**{state.value: state for state in WorkerState}, **{state.value.encode(): state for state in WorkerState}})


def _state(value: bytes | str) -> WorkerState:
    state = _STATES.get(value)
    return state if state is not None else WorkerState(_text(value))  # (an unknown state raises ValueError)


def _integer(value: bytes | str) -> int:
    return int(float(value))


def _sequence(value: bytes | str) -> tuple[Any, ...]:
    return tuple(orjson.loads(value))


def _decoder(annotation: object) -> Callable[[bytes | str], Any]:
    """How a field's Redis value (bytes or text) reads as its declared type (annotations are strings here:
    postponed evaluation)."""
    if annotation == "WorkerState":
        return _state
    if annotation == "int":
        return _integer
    if annotation == "float":
        return float
    if str(annotation).startswith("tuple"):
        return _sequence
    return _text


_FROM_FACTORY = object()
"""Stands in ``_DEFAULTS`` for a field whose default comes from a factory (``_FACTORIES``), called per record."""
_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default if f.default is not MISSING else _FROM_FACTORY for f in fields(WorkerRecord)
     if f.default is not MISSING or f.default_factory is not MISSING})
"""Each field's default (the fields without one, the identity, must come from Redis)."""
_FACTORIES = tuple((f.name, f.default_factory) for f in fields(WorkerRecord) if f.default_factory is not MISSING)
_DECODERS: Mapping[bytes | str, tuple[str, Callable[[bytes | str], Any]]] = MappingProxyType({
    key: (f.name, _decoder(f.type)) for f in fields(WorkerRecord) for key in (f.name, f.name.encode())})
"""Field name (text or bytes, as a Redis client answers) → (field, its decoder)."""
