"""``poolgate bench autoscale --sweep --out DIR``: the capacity planner's constants, chosen on virtual time.

The autoscale model (``bench.autoscale_model.simulate``: requests, worker start-up, drains, sleeping workers, the
production decision) runs each grid point over four traces, every one against the smallest static fleet that
meets the SLO on it:

- **plateaus**: the real benchmark's shape (``bench.autoscale_real``: 0.1-1.0 × 4 req/s, 15-s plateaus, two
  cycles and a last trough; one-sequence workers, ~0.5 s a request, TTFT SLO 2 s), and **plateaus-60s**, its
  ``--plateau-s 60 --cycles 3`` run, where the pool has time to change its mind inside a plateau;
- **diurnal**: the model's own half-hour day (``bench.autoscale_model.QUICK``: 30 req/s peak, 16 slots a worker);
- **bursty**: the day's trough with bursts to its peak, 20-40 s long, at random moments (a queue that no trend
  announces).

The grid: ``worker_capacity`` (as a share of what one worker can run at once), ``demand_window_s``, the doubt a
reversal must clear (``controller.autoscale.REVERSAL_DOUBT`` or none), and whether the surplus sleeps (wakes in
``WAKE_S``; deployed with all of it asleep, as the real run) or stops (starts again in the trace's start-up time).
Reported per point and trace: worker-seconds against the static fleet's, SLO attainment and, on plateaus, the
most direction changes inside one plateau, in ``autoscale_sweep.json`` and ``.md``. Virtual time: seconds to run,
and its figures do not depend on the host.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from bench.autoscale_model import QUICK, Scenario, reversals, simulate, static_for_peak
from controller.autoscale import REVERSAL_DOUBT
from poolgate.kernel.config import AutoscaleSettings, PoolScaling, WorkerTemplate

WAKE_S = 1.0
CAPACITY_SHARES = (0.6, 0.8, 1.0)
DEMAND_WINDOWS_S = (5.0, 10.0)
SLEEP_LEVELS = (0, 1)
REVERSAL_DOUBTS = (0.0, REVERSAL_DOUBT)


@dataclass(frozen=True)
class Plateaus(Scenario):
    """The real benchmark's staircase in virtual time."""

    plateau_s: float = 15.0
    levels: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 0.5, 0.25)
    cycles: int = 2

    def rate(self, t: float) -> float:
        steps = [*self.levels * self.cycles, 1 / self.peak_to_trough]
        return steps[min(int(t // self.plateau_s), len(steps) - 1)] * self.peak_rps

    def most_reversals(self, moves: list[tuple[float, str]]) -> int:
        """The most direction changes of the scale decisions inside one plateau (the real benchmark's target:
        at most one)."""
        spans = range(len(self.levels) * self.cycles + 1)
        return max((reversals([a for t, a in moves if i * self.plateau_s <= t < (i + 1) * self.plateau_s])
                    for i in spans), default=0)


@dataclass(frozen=True)
class Bursty(Scenario):
    """The trough, with bursts to the peak of ``burst_s``-``2 × burst_s`` at random moments."""

    burst_s: float = 20.0
    bursts: int = 6

    def rate(self, t: float) -> float:
        rng = random.Random(self.seed * 7919)
        trough = self.peak_rps / self.peak_to_trough
        for _ in range(self.bursts):
            start = rng.uniform(0.05, 0.9) * self.period_s
            if start <= t < start + rng.uniform(self.burst_s, 2 * self.burst_s):
                return self.peak_rps
        return trough


PLATEAUS = Plateaus(period_s=195.0, peak_rps=4.0, slots=1, service_mean_s=0.5, service_sigma=0.2, prefill_s=0.02,
                    startup_s=10.0, slo_ttft_s=2.0, seed=11)
TRACES: dict[str, Scenario] = {
    "plateaus": PLATEAUS,
    "plateaus-60s": replace(PLATEAUS, period_s=1140.0, plateau_s=60.0, cycles=3),
    "diurnal": QUICK,
    "bursty": Bursty(period_s=1800.0, peak_rps=30.0, startup_s=10.0, seed=7),
}


def settings_for(trace: Scenario, capacity_share: float, demand_window_s: float) -> AutoscaleSettings:
    return AutoscaleSettings(enabled=True, interval_s=1.0, up_waiting_per_worker=2.0, up_sustain_s=3.0,
                             down_running_per_worker=0.5 * trace.slots, down_cooldown_s=20.0,
                             worker_capacity=capacity_share * trace.slots, demand_window_s=demand_window_s,
                             trend_window_s=30.0)


def bounds_for(static_workers: int, sleep_level: int) -> PoolScaling:
    """A pool that sleeps its surplus is deployed with all of it asleep (``standby_workers``), as the real run."""
    most = max(2, math.ceil(static_workers * 4 / 3))
    return PoolScaling(min_workers=1, max_workers=most, sleep_level=sleep_level,
                       standby_workers=most - 1 if sleep_level else 0,
                       template=WorkerTemplate(extra_args=("--enable-sleep-mode",)))


def sweep(shares: tuple[float, ...], windows: tuple[float, ...]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    statics = {name: static_for_peak(trace) for name, trace in TRACES.items()}
    for share, window, doubt, sleep in itertools.product(shares, windows, REVERSAL_DOUBTS, SLEEP_LEVELS):
        row: dict[str, object] = {"capacity_share": share, "demand_window_s": window, "reversal_doubt": doubt,
                                  "sleep_level": sleep}
        for name, trace in TRACES.items():
            static = statics[name]
            auto = simulate(trace, None, settings_for(trace, share, window), bounds_for(static.workers_max, sleep),
                            wake_s=WAKE_S, reversal_doubt=doubt)
            cell: dict[str, object] = {
                "worker_seconds_ratio": round(auto.worker_seconds / static.worker_seconds, 3),
                "slo_attainment": auto.slo_attainment, "static_slo_attainment": static.slo_attainment,
                "static_workers": static.workers_max, "decisions": auto.decisions}
            if isinstance(trace, Plateaus):
                cell["most_reversals_in_a_plateau"] = trace.most_reversals(auto.moves)
            row[name] = cell
        rows.append(row)
    return rows


def main(out: Path, quick: bool = False) -> int:
    """The sweep's reports in ``out``; ``quick`` runs one grid point (capacity 1.0, 10-s window) per surplus."""
    rows = sweep((1.0,), (10.0,)) if quick else sweep(CAPACITY_SHARES, DEMAND_WINDOWS_S)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale_sweep.json").write_text(json.dumps({"kind": "model-sweep", "wake_s": WAKE_S, "rows": rows},
                                                         indent=2))
    lines = ["# Capacity planner constants on virtual time (worker-seconds / static, SLO attainment; on plateaus also "
             "the most direction changes inside one plateau)", "",
             "| capacity share | demand window | reversal doubt | surplus | " + " | ".join(TRACES) + " |",
             "|---|---|---|---|" + "---|" * len(TRACES)]
    for row in rows:
        cells = []
        for name in TRACES:
            cell = row[name]
            assert isinstance(cell, dict)
            reversed_ = f" / {cell['most_reversals_in_a_plateau']}" if "most_reversals_in_a_plateau" in cell else ""
            cells.append(f"{cell['worker_seconds_ratio']:.2f} / {cell['slo_attainment']:.2%}{reversed_}")
        lines.append(f"| {row['capacity_share']} | {row['demand_window_s']:g} s | {row['reversal_doubt']:g} | "
                     f"{'sleeps' if row['sleep_level'] else 'stops'} | " + " | ".join(cells) + " |")
    (out / "autoscale_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
