"""KV headroom: prefer the worker with the most KV cache left after this request is placed there.

score(w) = clamp((free_w − footprint_w) / capacity_w, 0, 1), where free_w = capacity × (1 − usage −
kv_reserve_fraction) − reserved_w (see ``filters.KvFits``) and footprint_w the request's tokens rounded up to
the worker's KV blocks. A worker whose capacity is unknown (0) scores 0: it may fit, but nothing says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.kv import kv_room_after
from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, ScorerPlugin
from poolgate.kernel.fleet import WorkerRecord


class KvHeadroom:
    name = "kv_headroom"

    def __init__(self, reserve_fraction: float) -> None:
        self.reserve_fraction = reserve_fraction

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        room = kv_room_after(candidates, request.total_tokens, self.reserve_fraction, context.reserved_kv_tokens)
        return [0.0 if left <= 0 else (left if left < 1 else 1.0) for left in room]


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin(
    "kv_headroom", lambda own, shared: KvHeadroom(shared.kv_reserve_fraction), NoSettings)
