"""The autoscale benchmark's model of one pool (``bench.autoscale`` runs it and reports; ``bench.autoscale_sweep``
sweeps it): a request-level discrete-event model on a diurnal trace, driven by the production decision function
(``controller.autoscale.decide``). See ``bench.autoscale`` for the trace, the fleet and what is reported.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.autoscale import REVERSAL_DOUBT, Action, PoolSample, decide
from poolgate.kernel.config import AutoscaleSettings, PoolScaling


@dataclass(frozen=True)
class Scenario:
    period_s: float = 7200.0
    peak_rps: float = 60.0
    peak_to_trough: float = 10.0
    slots: int = 16
    service_mean_s: float = 4.0
    service_sigma: float = 0.5
    prefill_s: float = 0.1
    startup_s: float = 20.0
    slo_ttft_s: float = 1.0
    slo_target: float = 0.99
    seed: int = 7

    def rate(self, t: float) -> float:
        trough = self.peak_rps / self.peak_to_trough
        shape = ((1 - math.cos(2 * math.pi * t / self.period_s)) / 2) ** 2
        return trough + (self.peak_rps - trough) * shape


QUICK = Scenario(period_s=1800.0, peak_rps=30.0, startup_s=10.0)
"""A quarter of the day and half the traffic; the shorter day needs proportionally quicker starts."""

SETTINGS = AutoscaleSettings(enabled=True, interval_s=2.0, up_waiting_per_worker=2.0, up_kv_usage=0.9,
                             up_sustain_s=4.0, down_running_per_worker=0.8 * 16, down_cooldown_s=40.0)
"""Bench policy: grow on slot (KV) pressure above 90 % before requests queue, shrink while one worker fewer
stays at or under 80 % busy. ``down_running_per_worker`` is in requests; it is rescaled to the slots."""


@dataclass
class _Worker:
    started_at: float
    ready_at: float
    running: int = 0
    draining: bool = False
    ended_at: float | None = None
    to_sleep: bool = False
    """Its drain ends in sleep (the pool sleeps its surplus): woken later as a new awake period."""


@dataclass
class Result:
    name: str
    workers_min: int
    workers_max: int
    worker_seconds: float
    requests: int
    slo_attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    decisions: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, workers, offered requests per second) every minute."""
    moves: list[tuple[float, str]] = field(default_factory=list)
    """(time, "up" or "down") of every scale decision."""


def reversals(actions: Sequence[str]) -> int:
    """How often consecutive scale decisions changed direction (up then down, or down then up)."""
    return sum(1 for a, b in itertools.pairwise(actions) if a != b)


def _arrivals(scenario: Scenario, rng: random.Random) -> list[float]:
    """Non-homogeneous Poisson arrivals by thinning."""
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(scenario.peak_rps)
        if t >= scenario.period_s:
            return times
        if rng.random() < scenario.rate(t) / scenario.peak_rps:
            times.append(t)


def simulate(scenario: Scenario, static_workers: int | None, settings: AutoscaleSettings = SETTINGS,
             bounds: PoolScaling | None = None, wake_s: float = 1.0,
             reversal_doubt: float = REVERSAL_DOUBT) -> Result:
    """One run: a fixed fleet of ``static_workers``, or the autoscaler within ``bounds`` when None. With
    ``bounds.sleep_level`` a surplus worker sleeps once drained and wakes in ``wake_s``; worker-seconds count
    the awake periods only. ``reversal_doubt`` is the decision's (``controller.autoscale.REVERSAL_DOUBT``)."""
    rng = random.Random(scenario.seed)
    arrivals = _arrivals(scenario, rng)
    mu = math.log(scenario.service_mean_s) - scenario.service_sigma ** 2 / 2
    services = [rng.lognormvariate(mu, scenario.service_sigma) for _ in arrivals]
    autoscaled = static_workers is None
    bounds = bounds or PoolScaling(min_workers=1, max_workers=200)
    # Both fleets start warm: the autoscaled one with what the trough needs at the scale-down threshold.
    trough_busy = scenario.rate(0.0) * scenario.service_mean_s / scenario.slots
    warm = max(bounds.min_workers, math.ceil(trough_busy * scenario.slots / max(1.0, settings.down_running_per_worker)))
    initial = warm if autoscaled else static_workers or 0
    workers = [_Worker(0.0, 0.0) for _ in range(initial)]
    events: list[tuple[float, int, str, int]] = []
    sequence = 0

    def push(at: float, kind: str, data: int) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (at, sequence, kind, data))

    for index, at in enumerate(arrivals):
        push(at, "arrive", index)
    if autoscaled:
        push(0.0, "tick", 0)
    for minute in range(int(scenario.period_s // 60) + 1):
        push(minute * 60.0, "record", 0)
    queue: list[int] = []
    queue_head = 0
    sleeping = bounds.standby_workers if autoscaled else 0  # deployed asleep (a woken spare is not replaced)
    ttfts: list[float] = []
    history: list[PoolSample] = []
    last_change: float | None = None
    decisions: dict[str, int] = {}
    moves: list[tuple[float, str]] = []
    timeline: list[tuple[float, int, float]] = []
    keep_s = max(settings.up_sustain_s, settings.down_cooldown_s, settings.trend_window_s,
                 scenario.startup_s) + 2 * settings.interval_s

    def serving(now: float) -> list[int]:
        return [i for i, w in enumerate(workers)
                if w.ended_at is None and not w.draining and w.ready_at <= now]

    def dispatch(now: float) -> None:
        nonlocal queue_head
        while queue_head < len(queue):
            open_workers = [i for i in serving(now) if workers[i].running < scenario.slots]
            if not open_workers:
                return
            chosen = min(open_workers, key=lambda i: workers[i].running)
            request = queue[queue_head]
            queue_head += 1
            workers[chosen].running += 1
            ttfts.append(now - arrivals[request] + scenario.prefill_s)
            push(now + services[request], "finish", chosen)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > scenario.period_s + 600:
            break
        if kind == "arrive":
            queue.append(data)
            dispatch(now)
        elif kind == "finish":
            worker = workers[data]
            worker.running -= 1
            if worker.draining and worker.running == 0:
                worker.ended_at = now
                sleeping += worker.to_sleep
            dispatch(now)
        elif kind == "ready":
            dispatch(now)
        elif kind == "record":
            timeline.append((now, sum(1 for w in workers if w.ended_at is None), round(scenario.rate(now), 2)))
        elif kind == "tick":
            if now < scenario.period_s:
                push(now + settings.interval_s, "tick", 0)
            alive = [w for w in workers if w.ended_at is None and not w.draining]
            ready = [workers[i] for i in serving(now)]
            running = sum(w.running for w in ready)
            kv = sum(w.running / scenario.slots for w in ready) / len(ready) if ready else 0.0
            history.append(PoolSample(now, len(alive), len(ready), len(queue) - queue_head, running, kv,
                                      demand=float(running + len(queue) - queue_head), sleeping=sleeping))
            history = [s for s in history if now - s.at <= keep_s]
            decision = decide(history, bounds, settings, now, last_change, startup_s=scenario.startup_s,
                              wake_s=wake_s, last_action=Action(moves[-1][1]) if moves else None,
                              reversal_doubt=reversal_doubt)
            decisions[decision.action.value] = decisions.get(decision.action.value, 0) + 1
            if decision.action is not Action.HOLD:
                moves.append((now, decision.action.value))
            if decision.action is Action.UP:
                for _ in range(decision.target - len(alive)):
                    delay = wake_s if sleeping else scenario.startup_s
                    sleeping -= 1 if sleeping else 0
                    workers.append(_Worker(now, now + delay))
                    push(now + delay, "ready", len(workers) - 1)
            elif decision.action is Action.DOWN:
                candidates = sorted((i for i, w in enumerate(workers) if w.ended_at is None and not w.draining),
                                    key=lambda i: (workers[i].ready_at <= now, workers[i].running))
                for index in candidates[:len(alive) - decision.target]:
                    workers[index].draining = True
                    workers[index].to_sleep = bool(bounds.sleep_level)
                    if workers[index].running == 0:
                        workers[index].ended_at = now
                        sleeping += workers[index].to_sleep
            if decision.action is not Action.HOLD:
                last_change = now
                if not settings.worker_capacity:
                    history = []
    end = scenario.period_s
    worker_seconds = sum(min(w.ended_at if w.ended_at is not None else end, end) - w.started_at
                         for w in workers if w.started_at < end)
    # Requests still queued at the end waited at least this long.
    ttfts += [end - arrivals[r] + scenario.prefill_s for r in queue[queue_head:]]
    ordered = sorted(ttfts)
    met = sum(1 for t in ordered if t <= scenario.slo_ttft_s)
    counts = [n for _, n, _ in timeline]
    return Result(
        name="autoscaled" if autoscaled else f"static-{static_workers}",
        workers_min=min(counts), workers_max=max(counts), worker_seconds=round(worker_seconds, 1),
        requests=len(ordered), slo_attainment=round(met / len(ordered), 5),
        ttft_p50_s=round(ordered[len(ordered) // 2], 4), ttft_p99_s=round(ordered[int(len(ordered) * 0.99)], 4),
        decisions=decisions, timeline=timeline, moves=moves,
    )


def static_for_peak(scenario: Scenario) -> Result:
    """The smallest static fleet that meets the SLO target on the trace (i.e. sized for its peak)."""
    low = 1
    high = max(2, math.ceil(scenario.peak_rps * scenario.service_mean_s / scenario.slots) * 2)
    best = simulate(scenario, high)
    while low < high:
        middle = (low + high) // 2
        result = simulate(scenario, middle)
        if result.slo_attainment >= scenario.slo_target:
            best, high = result, middle
        else:
            low = middle + 1
    return best
