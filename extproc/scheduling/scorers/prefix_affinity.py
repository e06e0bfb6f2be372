"""Prefix affinity: prefer the worker that last served the same session or the same leading prompt text,
whose engine likely still holds those KV blocks (vLLM's prefix cache) and so skips their prefill.

The request carries its affinity keys strongest first: the session key (``x-session-id`` or the body's
``user``), then hashes of its first k·chunk characters for k = n … 1 (see ``estimate.prefix_keys``). The
first key found in the affinity map whose worker is still a candidate names the worker w*:

score(w*) = 1 for a session key, else k / n (the share of the hashed prompt prefix it shares); 0 for every
other worker, and for all when no key is known.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, SameScore, ScorerPlugin
from poolgate.kernel.fleet import WorkerRecord


class PrefixAffinity:
    name = "prefix_affinity"

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        keys = request.affinity_keys
        if not keys:
            return SameScore(len(candidates))
        affinity = context.affinity
        has_session = bool(request.facts.session_id)
        prefix_count = len(keys) - has_session
        for position, key in enumerate(keys):
            worker_id = affinity.get(key)
            if worker_id is None:
                continue
            if has_session and position == 0:
                strength = 1.0
            else:
                strength = (prefix_count - (position - has_session)) / prefix_count
            for index, w in enumerate(candidates):
                if w.id == worker_id:
                    scores = [0.0] * len(candidates)
                    scores[index] = strength
                    return scores
        return SameScore(len(candidates))


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin(
    "prefix_affinity", lambda own, shared: PrefixAffinity(), NoSettings)
