"""dcgm-exporter's series (from its page or from Prometheus) → a ``GpuReading`` (pure).

Per GPU (``gpu`` label = index, ``UUID``), in MiB and percent as dcgm-exporter exports them::

    free  = DCGM_FI_DEV_FB_FREE
    total = DCGM_FI_DEV_FB_TOTAL, else FB_FREE + FB_USED + FB_RESERVED (reserved: driver's share, 0 if absent)
    used  = DCGM_FI_DEV_FB_USED
    utilization = DCGM_FI_DEV_GPU_UTIL / 100, else DCGM_FI_PROF_GR_ENGINE_ACTIVE (already 0..1)

A GPU without free, used and one utilisation series is left out (it would show facts it does not have).
Series of MIG instances (a ``GPU_I_ID`` label) are left out: a worker on a slice is named by a ``MIG-…`` id
the exporter does not label. In Kubernetes the exporter labels a GPU a pod holds with ``namespace`` and
``pod`` (one series per pod when pods share it by time-slicing); a Prometheus that did not honour the
exporter's labels renames them ``exported_namespace`` / ``exported_pod``, which win when present.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.gpu_sources.reading import LOCAL_NODE, GpuReading
from agent.gpus import GpuSample
from agent.podresources import PodKey

FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
GPU_FIELDS = (FB_FREE, FB_USED, FB_RESERVED, FB_TOTAL, GPU_UTIL, GR_ENGINE_ACTIVE)
"""The series a reading needs: all a Prometheus query asks for."""


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    labels: Mapping[str, str]
    value: float


def reading_from_series(series: Iterable[Series], *, node_label: str | None = None) -> GpuReading:
    """``node_label`` None: all series are this node's (its own exporter); else the label naming the node."""
    fields: dict[tuple[str, int], dict[str, float]] = {}
    uuids: dict[tuple[str, int], str] = {}
    pods: dict[PodKey, dict[str, None]] = {}  # ordered sets of UUIDs
    for one in series:
        labels = one.labels
        index_text, uuid = labels.get("gpu", ""), labels.get("UUID", "")
        if one.name not in GPU_FIELDS or not index_text.isdigit() or not uuid or labels.get("GPU_I_ID"):
            continue
        if not math.isfinite(one.value):
            continue
        node = LOCAL_NODE if node_label is None else labels.get(node_label, "")
        if node_label is not None and not node:
            continue  # a fleet-wide series without its node cannot be matched by index
        key = (node, int(index_text))
        fields.setdefault(key, {})[one.name] = one.value
        uuids[key] = uuid
        pod = labels.get("exported_pod") or labels.get("pod", "")
        namespace = labels.get("exported_namespace") or labels.get("namespace", "")
        if pod and namespace:
            pods.setdefault((namespace, pod), {})[uuid] = None
    nodes: dict[str, dict[int, GpuSample]] = {}
    for (node, index), values in sorted(fields.items()):
        sample = _sample(index, uuids[(node, index)], values)
        if sample is not None:
            nodes.setdefault(node, {})[index] = sample
    return GpuReading(nodes=nodes, pods={key: tuple(found) for key, found in pods.items()})


def _sample(index: int, uuid: str, values: Mapping[str, float]) -> GpuSample | None:
    free, used = values.get(FB_FREE), values.get(FB_USED)
    if GPU_UTIL in values:
        utilization = values[GPU_UTIL] / 100.0
    elif GR_ENGINE_ACTIVE in values:
        utilization = values[GR_ENGINE_ACTIVE]
    else:
        return None
    if free is None or used is None:
        return None
    total = values.get(FB_TOTAL) or free + used + values.get(FB_RESERVED, 0.0)
    return GpuSample(index=index, uuid=uuid, memory_total_mib=total, memory_free_mib=free,
                     memory_used_mib=used, utilization=min(1.0, max(0.0, utilization)))
