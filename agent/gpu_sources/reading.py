"""One reading of GPUs, from any source, and which of its GPUs are a given worker's (pure).

A worker's GPUs are named, in this order of precedence, by its GPU ids (``workers[].gpus``,
``CUDA_VISIBLE_DEVICES`` or the kubelet's PodResources: indices or ``GPU-…`` UUIDs), or else by the pod
labels dcgm-exporter puts on the GPUs a pod holds (worker id = pod name in ``kubernetes.namespace``). A UUID
names one GPU anywhere; an index names a GPU only on the worker's own node, so a reading of many nodes
(Prometheus) needs the worker's ``node``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.gpus import GpuSample, GpuSummary, combine
from agent.podresources import PodKey

LOCAL_NODE = ""
"""Node name under which node-local sources (NVML, this node's exporter) file their GPUs."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    nodes: Mapping[str, Mapping[int, GpuSample]] = field(default_factory=dict)
    """GPUs by node name, then index; a node-local source files them under ``LOCAL_NODE``."""
    pods: Mapping[PodKey, tuple[str, ...]] = field(default_factory=dict)
    """GPU UUIDs each pod holds, as the exporter's ``namespace``/``pod`` labels say."""
    by_uuid: Mapping[str, GpuSample] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_uuid", {s.uuid: s for gpus in self.nodes.values() for s in gpus.values()})

    @property
    def gpu_count(self) -> int:
        return len(self.by_uuid)

    def summary_for(self, devices: Iterable[int | str], *, node: str, pod: PodKey) -> GpuSummary | None:
        """The worker's GPUs taken together; None when it names none or one of them is not in this reading."""
        named = tuple(str(device) for device in devices) or self.pods.get(pod, ())
        on_node = self.nodes.get(LOCAL_NODE) or (self.nodes.get(node) if node else None) or {}
        chosen: list[GpuSample] = []
        for device in named:
            sample = on_node.get(int(device)) if device.isdigit() else self.by_uuid.get(device)
            if sample is None:
                return None
            chosen.append(sample)
        return combine(chosen)


NO_GPUS = GpuReading()


class GpuSource(Protocol):
    """What the agent reads its GPU facts from; ``read`` never raises (a failed read is ``NO_GPUS``)."""

    async def read(self) -> GpuReading: ...
    async def close(self) -> None: ...
