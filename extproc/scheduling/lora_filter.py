"""Adapter room: drop workers that could take a LoRA request only by evicting another adapter.

Keeps the workers where the adapter is running or waiting, or that have a free adapter slot, whenever at
least one candidate is such a worker; otherwise keeps them all (every worker would have to swap, and a
swap is slower than a refusal is useful). Requests that name no adapter pass untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc import errors
from extproc.scheduling.plugins import FilterPlugin, NoSettings, PickContext, PickRequest, Refusal
from extproc.scheduling.scorers.lora_affinity import adapter_score
from poolgate.kernel.fleet import WorkerRecord


class AdapterRoom:
    name = "lora_room"

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        adapter = request.adapter
        if adapter is None:
            return candidates
        kept = [w for w in candidates if adapter_score(adapter, w) > 0]
        return kept or candidates

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return errors.no_worker(request.model, 1)  # not reached: the filter keeps all rather than none


PLUGIN: FilterPlugin[NoSettings] = FilterPlugin("lora_room", lambda own, shared: AdapterRoom(), NoSettings)
