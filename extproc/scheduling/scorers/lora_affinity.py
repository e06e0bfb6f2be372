"""LoRA affinity: send an adapter request where the adapter is already in use, else where one fits.

score(w) = 1 if the adapter is running or waiting on w (``vllm:lora_requests_info``), 0.5 if w has a free
adapter slot (fewer adapters in use than ``max_loras``), else 0. A worker already batching the adapter serves
it without swapping weights; one with a free slot takes it without evicting another's. A request that names
no adapter scores 0 everywhere, so the weight changes nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, SameScore, ScorerPlugin
from poolgate.kernel.fleet import WorkerRecord

IN_USE = 1.0
FREE_SLOT = 0.5


def adapter_score(adapter: str, worker: WorkerRecord) -> float:
    if adapter in worker.lora_adapters:
        return IN_USE
    if len(worker.lora_adapters) < worker.max_loras:
        return FREE_SLOT
    return 0.0


class LoraAffinity:
    name = "lora_affinity"

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        adapter = request.adapter
        if adapter is None:
            return SameScore(len(candidates))
        return [adapter_score(adapter, w) for w in candidates]


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin(
    "lora_affinity", lambda own, shared: LoraAffinity(), NoSettings, default_weight=2.0)
