"""Max score: the candidate with the highest weighted total, a random one among near-ties.

tied = { i : total_i ≥ max(total) − TIE_TOLERANCE × full_score }; choose uniformly from ``tied``. The inputs
are estimates, and a difference far below their error (an idle worker whose prefill rate is known against
one still on the default) must not send every request to the same worker; the random draw also keeps
several extproc replicas facing the same state from all pinning the same worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

TIE_TOLERANCE = 0.01


class MaxScore:
    name = "max_score"

    def __init__(self, rng: random.Random | None = None, tolerance: float = TIE_TOLERANCE) -> None:
        self._rng = rng or random.Random()
        self.tolerance = tolerance

    def choose(self, totals: Sequence[float], full_score: float) -> int:
        floor = max(totals) - self.tolerance * full_score
        tied = [i for i, total in enumerate(totals) if total >= floor]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
