"""Autoscaling decisions: a pure function from a pool's recent metrics to a target worker count.

Scale up when pressure is sustained for ``up_sustain_s`` — requests waiting (engine queues plus extproc's
queue) per worker above ``up_waiting_per_worker``, mean KV usage above ``up_kv_usage``, or, with
``up_ttft_s`` set, the pool's observed time to first token above it while requests are in flight — and no
worker is still starting (a start takes seconds; deciding again before it serves would overshoot). The step is at
least ``up_step`` and grows with the backlog, so a 3× load step is met in one or two moves.
Scale down by one worker after ``down_cooldown_s`` of idleness (nothing waiting, the running requests
would fit on one worker fewer, and TTFT at most ``TTFT_DOWN_SHARE`` of its target, in ``DOWN_IDLE_SHARE`` of
the samples and the latest) and as long since the last scale event; the removal goes through a drain. The
gap between the up and the down conditions is the hysteresis that keeps a steady load near a threshold from
flapping the count. An empty pool (``min_workers: 0``) with any request waiting for it gets one worker at
once: there nothing can serve while pressure is being confirmed. Bounds (min/max) always win. Each decision
carries its reason, for the log line and the metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from poolgate.kernel.config import AutoscaleSettings, PoolScaling


@dataclass(frozen=True)
class PoolSample:
    at: float
    workers: int
    """Workers the pool has (serving or starting; not draining)."""
    ready: int
    """Of those, registered and serving."""
    waiting: int
    """Requests queued: engines' waiting queues plus extproc's queue for the pool."""
    running: int
    kv_usage: float
    """Mean over ready workers, 0..1."""
    ttft_s: float = -1.0
    """Observed time to first token: mean of the ready workers' TTFT EWMA (agent); -1 = unknown."""


DOWN_IDLE_SHARE = 0.8
"""A worker leaves once this share of the cooldown's samples, the current one among them, were idle: a request
that waits one engine step (it arrived as another finished) must not hold a pool at its peak size for good."""
TTFT_DOWN_SHARE = 0.5
"""A worker leaves only while the pool's TTFT is at most this share of ``up_ttft_s`` (hysteresis)."""


class Action(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class Decision:
    action: Action
    target: int
    reason: str


def _window(history: Sequence[PoolSample], now: float, span_s: float) -> list[PoolSample] | None:
    """Samples of the last ``span_s``, or None when the history does not yet cover that span."""
    if not history or now - history[0].at < span_s:
        return None
    return [s for s in history if now - s.at <= span_s]


def _pressure(sample: PoolSample, settings: AutoscaleSettings) -> str | None:
    per_worker = sample.waiting / max(1, sample.ready)
    if per_worker > settings.up_waiting_per_worker:
        return f"{per_worker:.1f} waiting per worker > {settings.up_waiting_per_worker:g}"
    if sample.kv_usage > settings.up_kv_usage:
        return f"KV usage {sample.kv_usage:.0%} > {settings.up_kv_usage:.0%}"
    ttft = _live_ttft(sample)
    if settings.up_ttft_s and ttft > settings.up_ttft_s:
        return f"TTFT {ttft:.2f} s > {settings.up_ttft_s:g} s"
    return None


def _live_ttft(sample: PoolSample) -> float:
    """The TTFT while requests are in flight; -1 when idle (an EWMA no new request updated is stale)."""
    return sample.ttft_s if sample.running or sample.waiting else -1.0


def decide(history: Sequence[PoolSample], bounds: PoolScaling, settings: AutoscaleSettings, now: float,
           last_change_at: float | None) -> Decision:
    """The pool's target size now; ``history`` is oldest first and ends with the current sample."""
    if not history:
        return Decision(Action.HOLD, bounds.min_workers, "no metrics yet")
    current = history[-1]
    if current.workers < bounds.min_workers:
        return Decision(Action.UP, bounds.min_workers, f"below min_workers {bounds.min_workers}")
    if current.workers > bounds.max_workers:
        return Decision(Action.DOWN, bounds.max_workers, f"above max_workers {bounds.max_workers}")
    if current.workers == 0 and current.waiting > 0:
        return Decision(Action.UP, min(bounds.max_workers, settings.up_step),
                        f"{current.waiting} request(s) waiting for an empty pool")
    recent = _window(history, now, settings.up_sustain_s)
    if recent is not None and all(_pressure(s, settings) for s in recent):
        reason = f"{_pressure(current, settings)} for {settings.up_sustain_s:g} s"
        if current.ready < current.workers:
            return Decision(Action.HOLD, current.workers,
                            f"{reason}; waiting for {current.workers - current.ready} starting worker(s)")
        if current.workers >= bounds.max_workers:
            return Decision(Action.HOLD, current.workers, f"{reason}; at max_workers {bounds.max_workers}")
        # Enough workers that the backlog per worker falls to the threshold, at least up_step more.
        wanted = math.ceil(current.waiting / settings.up_waiting_per_worker) if current.waiting else 0
        step = max(settings.up_step, min(wanted - current.workers, current.workers))
        target = min(bounds.max_workers, current.workers + step)
        return Decision(Action.UP, target, reason)
    if current.workers <= bounds.min_workers:
        return Decision(Action.HOLD, current.workers, "steady")
    if last_change_at is not None and now - last_change_at < settings.down_cooldown_s:
        return Decision(Action.HOLD, current.workers, "steady")
    quiet = _window(history, now, settings.down_cooldown_s)
    if quiet is None:
        return Decision(Action.HOLD, current.workers, "steady")
    fewer = current.workers - 1
    fits = settings.down_running_per_worker * fewer
    ttft_bound = TTFT_DOWN_SHARE * settings.up_ttft_s if settings.up_ttft_s else math.inf
    idle = [s for s in quiet if s.waiting == 0 and s.running <= fits
            and s.kv_usage <= settings.up_kv_usage and _live_ttft(s) <= ttft_bound]
    if idle and idle[-1] is current and len(idle) >= DOWN_IDLE_SHARE * len(quiet):
        return Decision(Action.DOWN, fewer,
                        f"idle for {settings.down_cooldown_s:g} s: {len(idle)} of {len(quiet)} samples with "
                        f"nothing waiting and at most {max(s.running for s in idle)} running (fits on {fewer} "
                        f"worker(s))")
    return Decision(Action.HOLD, current.workers, f"steady: {len(idle)} of {len(quiet)} samples of the last "
                    f"{settings.down_cooldown_s:g} s idle; {max(s.waiting for s in quiet)} waiting and "
                    f"{max(s.running for s in quiet)} running at most ({fits:g} fit on {fewer} worker(s))")
