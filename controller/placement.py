"""GPU-aware placement: which GPUs of this node a new worker goes on. Pure; the GPU facts come in.

A GPU fits when its free memory (NVML or a simulated card, as the agent reads it) minus what workers
already placed but not yet loaded will take covers the worker's need. Among fitting GPUs the ones with the
most free memory win, so workers spread before they pack. No fit is an answer with a reason, not an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFree:
    index: int
    memory_total_mib: float
    memory_free_mib: float


@dataclass(frozen=True)
class Placement:
    gpus: tuple[int, ...]
    """Indices for ``CUDA_VISIBLE_DEVICES``; empty when the worker needs no GPU."""
    reason: str

    @property
    def placed(self) -> bool:
        return bool(self.gpus) or self.reason == "no GPU needed"


def place(need_mib: float, gpu_count: int, gpus: Mapping[int, GpuFree],
          pending_mib: Mapping[int, float] | None = None) -> Placement:
    """Choose ``gpu_count`` GPUs with at least ``need_mib`` free each (after ``pending_mib`` reservations)."""
    if gpu_count == 0:
        return Placement((), "no GPU needed")
    pending = pending_mib or {}
    available = {index: gpu.memory_free_mib - pending.get(index, 0.0) for index, gpu in gpus.items()}
    fitting = sorted((index for index, free in available.items() if free >= need_mib),
                     key=lambda index: (-available[index], index))
    if len(fitting) >= gpu_count:
        chosen = tuple(sorted(fitting[:gpu_count]))
        return Placement(chosen, f"GPUs {','.join(map(str, chosen))} have ≥ {need_mib:.0f} MiB free")
    if not gpus:
        return Placement((), "refused: no GPU facts on this node (no NVML and no simulated GPU)")
    best = ", ".join(f"GPU {i}: {available[i]:.0f} MiB" for i in sorted(available))
    return Placement((), f"refused: needs {gpu_count} GPU(s) with {need_mib:.0f} MiB free each; "
                         f"only {len(fitting)} fit ({best})")
