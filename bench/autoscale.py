"""``poolgate bench autoscale --out DIR [--quick]``: autoscaled pool vs a static fleet sized for the peak.

This is the model (its JSON says ``"kind": "model"``), for long traces; ``--real`` runs a compressed trace
through the real stack instead (``bench.autoscale_real``).

A request-level discrete-event model of one pool on a diurnal trace (peak / trough = 10): Poisson arrivals
whose rate follows ``trough + (peak - trough) · ((1 - cos 2πt/T) / 2)²`` (a flat night and one daytime
peak), requests that hold one of a worker's ``slots`` for a lognormal service time, a pool queue in front
(extproc's), time to first token = queue wait + prefill. The autoscaled fleet is driven by the production
decision function (``controller.autoscale.decide``) sampled every ``interval_s``; new workers serve after
``startup_s``; removed workers drain (take nothing new, leave when their last request ends). The static
fleet is the smallest size that meets the SLO target on the same trace.

With capacity planning on (``worker_capacity``) each sample also carries the pool's demand (requests running
plus queued), and with the pool's ``sleep_level`` set a drained worker sleeps and wakes in ``wake_s`` instead
of starting in ``startup_s``; then worker-seconds count only the awake periods.

Reported: worker-seconds (every second a worker exists: starting, serving or draining) and SLO attainment
(share of requests whose TTFT ≤ ``slo_ttft_s``). A model, not a measurement of real engines: it tests the
scaling policy, not vLLM.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from bench import host_quiet
from bench.autoscale_model import QUICK, SETTINGS, Scenario, simulate, static_for_peak
from poolgate.kernel.config import PoolScaling


def run(scenario: Scenario, out: Path, quiet: host_quiet.Sampler | None = None) -> dict[str, object]:
    """The model run and its reports; ``quiet`` measures the host (a model's figures do not depend on it, but
    every report says how quiet the host was)."""
    settings = SETTINGS.model_copy(update={"down_running_per_worker": 0.8 * scenario.slots})
    static = static_for_peak(scenario)
    auto = simulate(scenario, None, settings, PoolScaling(min_workers=1, max_workers=static.workers_max * 2))
    ratio = auto.worker_seconds / static.worker_seconds
    verdict = ratio <= 0.6 and auto.slo_attainment >= static.slo_attainment
    summary: dict[str, object] = {
        "kind": "model", "scenario": asdict(scenario), "policy": settings.model_dump(),
        "static": {k: v for k, v in asdict(static).items() if k != "timeline"},
        "autoscaled": {k: v for k, v in asdict(auto).items() if k != "timeline"},
        "worker_seconds_ratio": round(ratio, 4), "goal": "ratio <= 0.60 at the same or better SLO attainment",
        "goal_met": verdict,
    }
    out.mkdir(parents=True, exist_ok=True)
    summary = host_quiet.attach(summary, quiet.summary() if quiet else None)
    (out / "autoscale.json").write_text(json.dumps(summary, indent=2))
    with (out / "autoscale_timeline.csv").open("w") as handle:
        handle.write("time_s,offered_rps,autoscaled_workers,static_workers\n")
        for (t, n, rate), (_, s, _) in zip(auto.timeline, static.timeline, strict=False):
            handle.write(f"{t:.0f},{rate},{n},{s}\n")
    lines = [
        "# Autoscaling vs a static fleet sized for the peak (model)",
        "",
        f"Diurnal trace: {scenario.period_s:.0f} s, {scenario.peak_rps:g} req/s peak, peak/trough "
        f"{scenario.peak_to_trough:g}; {scenario.slots} slots per worker, {scenario.service_mean_s:g} s mean service, "
        f"start-up {scenario.startup_s:g} s; SLO TTFT ≤ {scenario.slo_ttft_s:g} s, target {scenario.slo_target:.0%}.",
        "",
        "| fleet | workers (min–max) | worker-seconds | SLO attainment | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|",
    ]
    for result in (static, auto):
        lines.append(f"| {result.name} | {result.workers_min}–{result.workers_max} | {result.worker_seconds:,.0f} | "
                     f"{result.slo_attainment:.2%} | {result.ttft_p50_s:.2f} s | {result.ttft_p99_s:.2f} s |")
    lines += ["", f"Autoscaled worker-seconds: **{ratio:.0%}** of static; goal (≤ 60 % at the same or better "
                  f"attainment) {'met' if verdict else 'NOT met'}. Decisions: {auto.decisions}."]
    (out / "autoscale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


def main(argv: list[str] | None = None) -> int:
    from bench import autoscale_real, autoscale_wake

    parser = argparse.ArgumentParser(prog="poolgate bench autoscale", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the reports")
    parser.add_argument("--quick", action="store_true", help="a shorter, lighter trace (seconds, for CI)")
    parser.add_argument("--seed", type=int, default=None, help="arrivals' seed (default 7; 11 with --real)")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep the capacity planner's constants over plateaus, diurnal and bursty traces on "
                             "virtual time (``bench.autoscale_sweep``): autoscale_sweep.json and .md")
    real = parser.add_argument_group("real processes (--real)")
    real.add_argument("--real", action="store_true",
                      help="run a compressed trace through the real stack (``bench.autoscale_real``): "
                           "autoscale_real.json, .md and .png")
    autoscale_real.add_arguments(real)
    autoscale_wake.add_arguments(real)
    args = parser.parse_args(argv)
    if args.wake_ups:
        return autoscale_wake.run_wake_ups(args)
    if args.sweep:
        from bench import autoscale_sweep
        return autoscale_sweep.main(Path(args.out), quick=args.quick)
    if args.real:
        if args.seed is None:
            args.seed = autoscale_real.RealScenario().seed
        return autoscale_real.run_real(args)
    scenario = QUICK if args.quick else Scenario()
    scenario = Scenario(**{**asdict(scenario), "seed": 7 if args.seed is None else args.seed})
    with host_quiet.measure() as quiet:
        run(scenario, Path(args.out), quiet)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
