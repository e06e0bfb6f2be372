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

With ``worker_capacity`` set the pool is **capacity-planned** instead (``controller.autoscale_plan``): its
demand (extproc's in-flight and queued counts), that demand's trend and one worker's capacity at the SLO give
the workers needed when a worker started now would serve (``startup_s``, learned from the pool's own launches),
and the pool goes there at once — counting workers still starting, so a second rise during a start is met by a
second decision, and never waiting for a queue to form. The pressure rules above stay as a safety net for a
capacity set too high (requests waiting or late first tokens, not KV fill; they act only once no worker is
starting). On the way down a worker stays while the
demand of the last start-up time (wake-up time where the pool's engines sleep instead of stopping) needed it.
A pool that sleeps its surplus (``sleep_level``) counts its sleeping workers apart: scaling up wakes them
first (seconds) and starts new processes only for the rest. A planned move against the direction of the last one
must clear its threshold by ``REVERSAL_DOUBT`` standard errors of the demand's mean, a doubt that fades over
``REVERSAL_FADE_WINDOWS`` demand windows: a change of mind needs more than noise. The way up is doubted only while
a sleeping worker would answer it (a worker that has to start would come a start-up late already).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller import autoscale_plan
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
    demand: float = -1.0
    """Requests extproc has in flight on the pool's workers plus those it holds for the pool; -1 = unknown."""
    sleeping: int = 0
    """Workers whose engine sleeps (not in ``workers``): they wake in seconds instead of starting in minutes."""


DOWN_IDLE_SHARE = 0.8
"""A worker leaves once this share of the cooldown's samples, the current one among them, were idle: a request
that waits one engine step (it arrived as another finished) must not hold a pool at its peak size for good."""
TTFT_DOWN_SHARE = 0.5
"""A worker leaves only while the pool's TTFT is at most this share of ``up_ttft_s`` (hysteresis)."""


HOLD_WINDOWS = 1.0
"""Capacity planning: a worker stays at least this many demand windows after the last change, however quick its
way back (a wake-up), so the level that released it is not the one that just added it. One: the model's sweep
of plateaus (``bench.autoscale``) found two windows cost 5-15 % more worker-seconds for no better SLO."""


REVERSAL_DOUBT = 3.0
"""Capacity planning: a move against the direction of the last one must clear its threshold by this many
standard errors of the window's mean demand (the way up by its lower bound, the way down by its upper bound).
A level that sits between two sizes moves its ten-second mean across the boundary and back by noise alone; without
this the 60-s plateaus of the real benchmark changed direction up to three times a plateau. Three: on the model's
60-s plateaus (``bench.autoscale --sweep``, capacity 1.0, 10-s window, surplus asleep) it takes the most direction
changes in a plateau from 2-3 to 1 for the same worker-seconds; over sixteen seeds two standard errors left two a
plateau on most of them, four cost more worker-seconds."""
REVERSAL_FADE_WINDOWS = 6.0
"""The doubt falls linearly to nothing over this many demand windows after the last move: a reversal that soon is
noise more often than news, while one minutes later answers a load that has really changed."""


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
    # A planned pool's KV fill is its capacity at work, not unmet demand (an engine of a few sequences reads
    # full whenever it runs); only requests that wait or start late say the plan fell short.
    if sample.kv_usage > settings.up_kv_usage and not settings.worker_capacity:
        return f"KV usage {sample.kv_usage:.0%} > {settings.up_kv_usage:.0%}"
    ttft = _live_ttft(sample)
    if settings.up_ttft_s and ttft > settings.up_ttft_s:
        return f"TTFT {ttft:.2f} s > {settings.up_ttft_s:g} s"
    return None


def _live_ttft(sample: PoolSample) -> float:
    """The TTFT while requests are in flight; -1 when idle (an EWMA no new request updated is stale)."""
    return sample.ttft_s if sample.running or sample.waiting else -1.0


def decide(history: Sequence[PoolSample], bounds: PoolScaling, settings: AutoscaleSettings, now: float,
           last_change_at: float | None, *, startup_s: float | None = None,
           wake_s: float | None = None, last_action: Action | None = None,
           reversal_doubt: float = REVERSAL_DOUBT) -> Decision:
    """The pool's target size now (awake workers); ``history`` is oldest first and ends with the current sample.
    ``startup_s`` and ``wake_s`` are what the pool's own launches and wake-ups measured (None: the settings');
    ``last_action`` is the direction of the change made at ``last_change_at``."""
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
    if settings.worker_capacity > 0 and current.demand >= 0:
        return _planned(history, bounds, settings, now, last_change_at,
                        startup_s or settings.startup_s, wake_s or settings.wake_s,
                        _doubt(settings, now, last_change_at, last_action, reversal_doubt))
    pressed = _sustained_pressure(history, bounds, settings, now, last_change_at)
    if pressed is not None:
        return pressed
    return _reactive_down(history, bounds, settings, now, last_change_at)


def _sustained_pressure(history: Sequence[PoolSample], bounds: PoolScaling, settings: AutoscaleSettings,
                        now: float, last_change_at: float | None) -> Decision | None:
    """A step up after ``up_sustain_s`` of pressure since the last change (HOLD while a worker starts or at
    the maximum); None without sustained pressure."""
    current = history[-1]
    if last_change_at is not None and now - last_change_at < settings.up_sustain_s:
        return None
    recent = _window(history, now, settings.up_sustain_s)
    if recent is None or not all(_pressure(s, settings) for s in recent):
        return None
    reason = f"{_pressure(current, settings)} for {settings.up_sustain_s:g} s"
    if current.ready < current.workers:
        return Decision(Action.HOLD, current.workers,
                        f"{reason}; waiting for {current.workers - current.ready} starting worker(s)")
    if current.workers >= bounds.max_workers:
        return Decision(Action.HOLD, current.workers, f"{reason}; at max_workers {bounds.max_workers}")
    # Enough workers that the backlog per worker falls to the threshold, at least up_step more.
    wanted = math.ceil(current.waiting / settings.up_waiting_per_worker) if current.waiting else 0
    step = max(settings.up_step, min(wanted - current.workers, current.workers))
    return Decision(Action.UP, min(bounds.max_workers, current.workers + step), reason)


def _reactive_down(history: Sequence[PoolSample], bounds: PoolScaling, settings: AutoscaleSettings, now: float,
                   last_change_at: float | None) -> Decision:
    current = history[-1]
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


def _doubt(settings: AutoscaleSettings, now: float, last_change_at: float | None, last_action: Action | None,
           reversal_doubt: float) -> dict[Action, float]:
    """Standard errors of the mean demand a move up and a move down must clear: ``reversal_doubt`` against the last
    move's direction, fading over ``REVERSAL_FADE_WINDOWS`` demand windows; nothing the same way."""
    doubt = {Action.UP: 0.0, Action.DOWN: 0.0}
    if last_change_at is not None and last_action in doubt:
        fade_s = REVERSAL_FADE_WINDOWS * settings.demand_window_s
        against = Action.DOWN if last_action is Action.UP else Action.UP
        doubt[against] = reversal_doubt * max(0.0, 1.0 - (now - last_change_at) / fade_s)
    return doubt


def _planned(history: Sequence[PoolSample], bounds: PoolScaling, settings: AutoscaleSettings, now: float,
             last_change_at: float | None, startup_s: float, wake_s: float, doubt: dict[Action, float]) -> Decision:
    """Capacity planning (``controller.autoscale_plan``), with the pressure rules as a safety net; ``doubt``: the
    standard errors a move each way must clear."""
    current = history[-1]
    capacity = settings.worker_capacity
    points = [autoscale_plan.DemandPoint(s.at, s.demand) for s in history if s.demand >= 0]
    # Doubting a move up delays it; only a pool with a sleeping worker to wake can afford that (a start-up more
    # of waiting would cost the SLO what the doubt saves in flapping).
    up_doubt = doubt[Action.UP] if current.sleeping else 0.0
    down_doubt = doubt[Action.DOWN]
    planned = autoscale_plan.plan(points, now, capacity=capacity, startup_s=startup_s,
                                  demand_window_s=settings.demand_window_s, trend_window_s=settings.trend_window_s,
                                  doubt=up_doubt)
    if current.sleeping and planned.needed <= current.workers + current.sleeping:
        # Sleeping workers cover what a start would have to: they need looking ahead only by a wake-up.
        planned = autoscale_plan.plan(points, now, capacity=capacity, startup_s=wake_s,
                                      demand_window_s=settings.demand_window_s,
                                      trend_window_s=settings.trend_window_s, doubt=up_doubt)
    target = min(bounds.max_workers, max(bounds.min_workers, planned.needed))
    starting = current.workers - current.ready
    if target > current.workers:
        woken = min(current.sleeping, target - current.workers)
        return Decision(Action.UP, target, planned.describe(capacity)
                        + (f"; counting {starting} starting" if starting else "")
                        + (f"; wakes {woken} sleeping" if woken else ""))
    pressed = _sustained_pressure(history, bounds, settings, now, last_change_at)
    if pressed is not None:
        return pressed
    steady = f"steady: {planned.describe(capacity)}"
    if current.workers <= bounds.min_workers:
        return Decision(Action.HOLD, current.workers, steady)
    # A worker put to sleep comes back in a wake-up; one still starting cannot sleep (it would be stopped, its
    # launch wasted), so while any starts the pool holds for a start-up as a pool that stops its surplus does.
    sleeps = bool(bounds.sleep_level) and starting == 0
    hold_s = max(wake_s if sleeps else startup_s, HOLD_WINDOWS * settings.demand_window_s)
    way_back = "wake-up" if sleeps else "start-up"
    if (last_change_at is not None and now - last_change_at < hold_s) or now - points[0].at < hold_s:
        return Decision(Action.HOLD, current.workers, f"{steady}; within a {way_back} time ({hold_s:.0f} s) of "
                        "the last change or of the first sample")
    kept, peak = autoscale_plan.keep(points, now, capacity=capacity, hold_s=hold_s,
                                     demand_window_s=settings.demand_window_s, doubt=down_doubt)
    kept = max(kept, planned.needed, bounds.min_workers)
    why = (f"demand peaked at {peak:.2f} over the last {hold_s:.0f} s ({way_back} time): {kept} worker(s) carry it "
           f"at {autoscale_plan.DOWN_FILL:.0%} of {capacity:g}")
    if kept < current.workers:
        return Decision(Action.DOWN, kept, why + ("; the rest sleep" if sleeps else ""))
    return Decision(Action.HOLD, current.workers, f"steady: {why}")
