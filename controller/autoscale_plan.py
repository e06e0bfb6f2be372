"""Capacity planning for one pool: how many workers its demand needs by the time a new one could serve.

A pool's **demand** is the number of requests it is asked to carry at once: extproc's own counts of the
requests it has in flight on the pool's workers plus those it holds in its queue for the pool (never the
engines' scraped queues, which lag and read 0 for a starved engine). By Little's law that is the arrival rate
times the time a request holds its worker, so it follows the offered load in the unit a worker's capacity is
measured in, whatever the mix of prompt and output lengths.

    level      = mean demand over the last ``demand_window_s``          (smooths Poisson noise)
    trend      = the least of the least-squares slopes of demand over   (requests per second, per second)
                 ``trend_window_s`` and over each of its halves
    forecast   = level + max(0, trend) × startup_s                      (what the pool carries when a worker
                                                                          started now would serve)
    needed     = ⌈forecast / worker_capacity⌉

``worker_capacity`` is what one worker carries while its time to first token stays within the SLO (from the
lab's capacity sweep or the fleet's own figures); ``startup_s`` is the pool's start-up time as learned from its
own launches. The trend is a rise that held over the whole window: a single step (a burst) fits a steep line
through the window but no slope in its older half, so it is met as the level it reached, not extrapolated
into a flood. A falling trend is not extrapolated either: removing workers on a forecast would pay a start-up
when it is wrong.

On the way down the pool keeps every worker that its demand needed within the last ``hold_s`` — the start-up
time of a worker that would be stopped, or the wake-up time of one that would be put to sleep — at a fill of
``DOWN_FILL`` of capacity:

    keep       = ⌈max(level over the last hold_s) / (worker_capacity × DOWN_FILL)⌉

so a dip shorter than the time it takes to bring a worker back costs nothing, and a load that sits between
two sizes does not flap the count (it must fall by the ``1 - DOWN_FILL`` band to release a worker).

A move against the direction of the pool's last one takes a ``doubt`` (``controller.autoscale``): the level it is
decided on is the window's mean moved by that many standard errors of the mean, down for a move up and up for a
move down,

    level ± doubt × stdev(demand in the window) / √(samples in the window)

so the noise of a ten-second mean (a worker's worth at a few requests per second) does not undo the last move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DOWN_FILL = 0.9
"""A worker leaves only if the workers that stay would carry the held-over peak at this share of capacity."""


@dataclass(frozen=True)
class DemandPoint:
    at: float
    demand: float
    """Requests in flight on the pool's workers plus requests extproc holds for it."""


@dataclass(frozen=True)
class Plan:
    level: float
    trend_per_s: float
    forecast: float
    horizon_s: float
    needed: int

    def describe(self, capacity: float) -> str:
        return (f"demand {self.level:.2f} (trend {self.trend_per_s:+.3f}/s) → {self.forecast:.2f} in "
                f"{self.horizon_s:.0f} s: {self.needed} worker(s) at {capacity:g} each")


def level(points: Sequence[DemandPoint], now: float, window_s: float, doubt: float = 0.0) -> float:
    """Mean demand over the last ``window_s`` (the latest point alone when the window holds no other), moved by
    ``doubt`` standard errors of that mean (negative: its lower bound)."""
    recent = [p.demand for p in points if now - p.at <= window_s]
    if not recent:
        return points[-1].demand if points else 0.0
    mean = sum(recent) / len(recent)
    if not doubt or len(recent) < 2:
        return mean
    spread = math.sqrt(sum((d - mean) ** 2 for d in recent) / (len(recent) - 1))
    return max(0.0, mean + doubt * spread / math.sqrt(len(recent)))


def trend(points: Sequence[DemandPoint], now: float, window_s: float) -> float:
    """The sustained slope of demand: the least of the slopes over the last ``window_s`` and its two halves."""
    recent = [p for p in points if now - p.at <= window_s]
    older = [p for p in recent if now - p.at >= window_s / 2]
    newer = [p for p in recent if now - p.at <= window_s / 2]
    return min(slope(recent), slope(older), slope(newer))


def slope(recent: Sequence[DemandPoint]) -> float:
    """Least-squares slope of demand over ``recent``; 0 with fewer than three points."""
    if len(recent) < 3:
        return 0.0
    mean_t = sum(p.at for p in recent) / len(recent)
    mean_d = sum(p.demand for p in recent) / len(recent)
    spread = sum((p.at - mean_t) ** 2 for p in recent)
    if spread <= 0:
        return 0.0
    return sum((p.at - mean_t) * (p.demand - mean_d) for p in recent) / spread


def plan(points: Sequence[DemandPoint], now: float, *, capacity: float, startup_s: float,
         demand_window_s: float, trend_window_s: float, doubt: float = 0.0) -> Plan:
    """Workers needed when a worker started now would serve (module docstring)."""
    current = level(points, now, demand_window_s, -doubt)
    slope = trend(points, now, trend_window_s)
    forecast = current + max(0.0, slope) * startup_s
    return Plan(current, slope, forecast, startup_s, _workers_for(forecast, capacity))


def keep(points: Sequence[DemandPoint], now: float, *, capacity: float, hold_s: float,
         demand_window_s: float, doubt: float = 0.0) -> tuple[int, float]:
    """Workers to keep and the peak level they keep for: the most the last ``hold_s`` needed at ``DOWN_FILL``."""
    peak = max((level([q for q in points if q.at <= p.at], p.at, demand_window_s, doubt)
                for p in points if now - p.at <= hold_s), default=0.0)
    return _workers_for(peak, capacity * DOWN_FILL), peak


def _workers_for(demand: float, capacity: float) -> int:
    # A hair below a whole number is that number: 2.0000001 requests at 1 each is two workers, not three.
    return max(0, math.ceil(demand / capacity - 1e-9))
