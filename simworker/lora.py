"""LoRA adapters of one simulated worker: which are loaded, which requests use them, and the metric.

vLLM loads adapters at run time through ``/v1/load_lora_adapter`` and reports the adapters of requests in
flight in ``vllm:lora_requests_info`` (labels ``max_lora``, ``running_lora_adapters``,
``waiting_lora_adapters``; value = the Unix time of the update, old label sets stay). A router reading it
sees only adapters with requests, never an idle loaded one; the simulator keeps that blind spot.

Simplification: here ``max_loras`` caps the *loaded* adapters (a load beyond it is refused), where vLLM
caps adapters per batch and keeps more in CPU memory; it gives the router a slot limit it can observe.

Like vLLM, a load is refused (500) when the adapter's rank (``r`` in its ``adapter_config.json``, or the largest of
its ``rank_pattern``) exceeds ``--max-lora-rank``. Unlike vLLM, a path with no ``adapter_config.json`` is accepted
(vLLM answers 404): tests and benchmarks name adapters that exist only by name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from simworker.protocol import WorkerApiError

LORA_INFO = "vllm:lora_requests_info"
DEFAULT_MAX_LORA_RANK = 16
"""vLLM's default ``--max-lora-rank``."""


def adapter_rank(path: str) -> int | None:
    """The largest rank an adapter declares in its ``adapter_config.json`` (PEFT's layout), None where the path
    holds no readable one."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    return max((rank for rank in ranks if isinstance(rank, int)), default=None)


@dataclass
class _InFlight:
    adapter: str
    running: bool = False


@dataclass
class AdapterTable:
    max_loras: int
    registry: CollectorRegistry
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    clock: Callable[[], float] = time.time
    loaded: dict[str, str] = field(default_factory=dict)
    """Adapter name → path, in load order (including loads still paying their cost)."""
    _requests: dict[str, _InFlight] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._gauge = Gauge(LORA_INFO, "Running stats on lora requests.",
                            ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), registry=self.registry)
        self._publish()

    def reserve(self, name: str, path: str) -> None:
        """Claim a slot before the load cost is paid, so a concurrent load of the same name is refused."""
        if name in self.loaded:
            raise WorkerApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        rank = adapter_rank(path)
        if rank is not None and rank > self.max_lora_rank:
            raise WorkerApiError(500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.")
        if len(self.loaded) >= self.max_loras:
            raise WorkerApiError(400, f"Cannot load lora adapter '{name}': all {self.max_loras} adapter slots are in "
                                "use (--max-loras); unload one first.", "lora_name")
        self.loaded[name] = path

    def release(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise WorkerApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")

    def begin(self, request_id: str, adapter: str) -> None:
        self._requests[request_id] = _InFlight(adapter)
        self._publish()

    def started(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None and not entry.running:
            entry.running = True
            self._publish()

    def end(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._publish()

    def _publish(self) -> None:
        running = sorted({r.adapter for r in self._requests.values() if r.running})
        waiting = sorted({r.adapter for r in self._requests.values() if not r.running} - set(running))
        self._gauge.labels(max_lora=str(self.max_loras), running_lora_adapters=",".join(running),
                           waiting_lora_adapters=",".join(waiting)).set(self.clock())
