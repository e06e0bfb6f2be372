"""The peers benchmark's report: targets against the best other router, Markdown tables, CDF and load plots.

A row is one router on one (fleet, scenario, arrivals, load) cell (``measure.summarise_run`` plus those
keys). Targets, at 85 % load on every cell: poolgate's TTFT p99 ≤ 0.5 × the best other router's,
goodput ≥ the best other's, output tokens/s ≥ the best other's − 2 %, prefix-cache hit rate ≥ the best
other's. "Best" is taken per metric over the other routers run in that cell, the oracle apart: where it
ran, poolgate's prefix-cache hit rate is held to ``ORACLE_HIT_SHARE`` × the oracle's instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.host_quiet import HostQuiet, attach, describe
from bench.measure import json_safe
from bench.report import Column, format_table, plot_ttft_cdf, write_report

TARGET_LEVEL = 0.85
TARGETS = (
    # metric, lower is better, factor on the best other, text
    ("ttft_p99_s", True, 0.5, "TTFT p99 ≤ 0.5 × best other"),
    ("goodput_ratio", False, 1.0, "goodput ≥ best other"),
    ("output_tokens_per_s", False, 0.98, "output tok/s ≥ best other − 2 %"),
    ("prefix_hit_rate", False, 1.0, "prefix-cache hit rate ≥ best other"),
)
ORACLE = "oracle"
ORACLE_HIT_SHARE = 0.9
CELL_KEYS = ("fleet", "scenario", "arrivals")


def cell_of(row: Mapping[str, Any]) -> tuple[str, str, str]:
    return row["fleet"], row["scenario"], row["arrivals"]


def _value(row: Mapping[str, Any], metric: str) -> float:
    value = row.get(metric)
    return float(value) if isinstance(value, int | float) else math.nan


def evaluate_targets(rows: Sequence[Mapping[str, Any]], level: float = TARGET_LEVEL) -> list[dict[str, Any]]:
    """One entry per cell and target at ``level``: poolgate, the best other router and whether it is met."""
    cells: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        if math.isclose(row["level"], level):
            cells.setdefault(cell_of(row), []).append(row)
    results = []
    for cell, cell_rows in cells.items():
        ours = next((r for r in cell_rows if r["policy"] == "poolgate"), None)
        others = [r for r in cell_rows if r["policy"] not in ("poolgate", ORACLE)]
        oracle = next((r for r in cell_rows if r["policy"] == ORACLE), None)
        if ours is None:
            continue
        if oracle is not None and not math.isnan(hit := _value(oracle, "prefix_hit_rate")):
            mine = _value(ours, "prefix_hit_rate")
            results.append({"fleet": cell[0], "scenario": cell[1], "arrivals": cell[2],
                            "target": f"prefix-cache hit rate ≥ {ORACLE_HIT_SHARE:g} × oracle's",
                            "metric": "prefix_hit_rate", "poolgate": mine, "best_other": hit, "best_router": ORACLE,
                            "bound": ORACLE_HIT_SHARE * hit, "met": bool(mine >= ORACLE_HIT_SHARE * hit)})
        if not others:
            continue
        for metric, lower_better, factor, text in TARGETS:
            candidates = [(v, r["policy"]) for r in others if not math.isnan(v := _value(r, metric))]
            if not candidates or math.isnan(_value(ours, metric)):
                continue
            best, best_router = min(candidates) if lower_better else max(candidates)
            bound = factor * best
            mine = _value(ours, metric)
            met = mine <= bound if lower_better else mine >= bound
            if lower_better and math.isinf(best) and math.isinf(mine):
                met = False
            results.append({"fleet": cell[0], "scenario": cell[1], "arrivals": cell[2], "target": text,
                            "metric": metric, "poolgate": mine, "best_other": best, "best_router": best_router,
                            "bound": bound, "met": bool(met)})
    return results


COLUMNS = [
    Column("level_pct", "load", "{:.0f}%"), Column("policy", "router"), Column("offered_rps", "req/s", "{:.2f}"),
    Column("sent", "sent", "{:d}"), Column("completed", "done", "{:d}"), Column("refused", "429", "{:d}"),
    Column("errors", "err", "{:d}"), Column("timed_out", "t/o", "{:d}"),
    Column("ttft_p50_s", "TTFT p50", "{:.3f}"), Column("ttft_p99_s", "TTFT p99", "{:.3f}"),
    Column("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"), Column("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    Column("goodput_ratio", "goodput", "{:.3f}"), Column("output_tokens_per_s", "out tok/s", "{:.0f}"),
    Column("preemptions", "preempt", "{:d}"), Column("prefix_hit_pct", "prefix hit", "{:.1f}%"),
]
HEALTH_COLUMNS = [
    Column("level_pct", "load", "{:.0f}%"), Column("policy", "router"),
    Column("arrival_lateness_p99_ms", "arrival late p99 ms", "{:.1f}"),
    Column("sim_step_lag_mean_ms", "sim lag mean ms", "{:.2f}"), Column("sim_lag_share", "lag/step", "{:.3f}"),
    Column("bench_cpu_cores", "bench CPU cores", "{:.2f}"), Column("host_cpu_busy", "host CPU", "{:.0%}"),
]


def _table_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, **r["health"], "level_pct": r["level"] * 100, "tpot_p50_ms": r["tpot_p50_s"] * 1000,
             "tpot_p99_ms": r["tpot_p99_s"] * 1000, "prefix_hit_pct": r["prefix_hit_rate"] * 100} for r in rows]


def _fmt(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.3f}"


def results_tables(report: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for cell in report["cells"]:
        rows = [r for r in report["rows"] if cell_of(r) == (cell["fleet"], cell["scenario"], cell["arrivals"])]
        if not rows:
            continue
        weights = ", ".join(f"{w} {n}" for w, n in sorted(cell.get("weights", {}).items()))
        lines += [f"### {cell['fleet']} · {cell['scenario']} · {cell['arrivals']} arrivals", "",
                  f"Capacity {cell['capacity']}. Router order: "
                  f"{', '.join(cell['order'])}. Weighted least_request weights: {weights or '-'}.", "",
                  "```", format_table(_table_rows(rows), COLUMNS), "```", ""]
    return lines


def targets_table(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    if not targets:
        return ["Not evaluated (no cell had poolgate and another router at 85 %)."]
    lines = ["| fleet | scenario | arrivals | target | poolgate | best other (router) | bound | result |",
             "|---|---|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['fleet']} | {t['scenario']} | {t['arrivals']} | {t['target']} | {_fmt(t['poolgate'])} | "
                     f"{_fmt(t['best_other'])} ({t['best_router']}) | {_fmt(t['bound'])} | "
                     f"{'met' if t['met'] else '**missed**'} |")
    met = sum(t["met"] for t in targets)
    lines += ["", f"**{met} of {len(targets)} targets met.**"]
    return lines


def markdown(report: Mapping[str, Any]) -> str:
    lines = [
        "# poolgate against the routers users would pick instead", "",
        f"Commit {report['commit']}. Wall time {report['wall_s'] / 60:.1f} min. {describe(report.get('host'))}.",
        "",
        f"Time scale "
        f"{report['time_scale']:g} (the modelled GPUs run {1 / report['time_scale']:g}× slower than real time; "
        "every control-loop interval is scaled alike); times and rates are model seconds unless marked wall.",
        "",
        f"Peers: {report['peers']}. Seed {report['seed']}; per router and cell a {report['window_model_s']:.1f} s "
        f"(model) arrival window, first tokens awaited {report['drain_model_s']:.1f} s more, then cut.", "",
        "Fleets: " + "; ".join(f"**{name}** ({text})" for name, text in report["fleets"].items()) + ".", "",
        "Every router gets the same trace on an idle fleet whose prefix caches were just reset. TTFT p50/p99 "
        "over every sent request (refused, failed and timed-out ones count as +∞, shown as inf); goodput = "
        "share of sent requests answered within their class's TTFT SLO; TPOT over requests with ≥ 2 tokens; "
        "out tok/s = tokens received during the arrival window; prefix hit = token-weighted hit rate from the "
        "workers' counters; 429 = refused, t/o = cut before a first token.", "",
        "## Targets at 85 % load (poolgate vs the best other router per metric)", "",
        *targets_table(report["targets"]), "",
        "## Results", "", *results_tables(report),
        "## Harness health (wall time)", "",
    ]
    for cell in report["cells"]:
        rows = [r for r in report["rows"] if cell_of(r) == (cell["fleet"], cell["scenario"], cell["arrivals"])]
        if rows:
            lines += [f"{cell['fleet']} · {cell['scenario']} · {cell['arrivals']}:", "", "```",
                      format_table(_table_rows(rows), HEALTH_COLUMNS), "```", ""]
    return "\n".join(lines)


def _cells_at(report: Mapping[str, Any], level: float) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    for row in report["rows"]:
        if math.isclose(row["level"], level) and cell_of(row) not in seen:
            seen.append(cell_of(row))
    return seen


def plot_cdfs(report: Mapping[str, Any], axes: Any) -> None:
    axes_list = axes if isinstance(axes, list) else [axes]
    for axis, cell in zip(axes_list, _cells_at(report, TARGET_LEVEL), strict=False):
        for row in (r for r in report["rows"] if cell_of(r) == cell and math.isclose(r["level"], TARGET_LEVEL)):
            plot_ttft_cdf(axis, row["ttft_samples_s"], row["sent"], row["policy"])
        axis.set_xscale("log")
        axis.set_title(f"TTFT CDF, {cell[0]} · {cell[1]} · {cell[2]}, 85 %", fontsize="small")
        axis.set_xlabel("TTFT (model s)")
        axis.set_ylabel("share of sent requests")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="x-small")


def plot_goodput(report: Mapping[str, Any], axes: Any) -> None:
    swept = [cell for cell in {cell_of(r) for r in report["rows"]}
             if len({r["level"] for r in report["rows"] if cell_of(r) == cell}) > 1]
    axes_list = axes if isinstance(axes, list) else [axes]
    for axis, cell in zip(axes_list, sorted(swept), strict=False):
        for router in sorted({r["policy"] for r in report["rows"] if cell_of(r) == cell}):
            points = sorted((r["level"] * 100, r["goodput_ratio"]) for r in report["rows"]
                            if cell_of(r) == cell and r["policy"] == router)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=router)
        axis.set_title(f"goodput vs load, {cell[0]} · {cell[1]} · {cell[2]}", fontsize="small")
        axis.set_xlabel("load (% of capacity)")
        axis.set_ylabel("goodput")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="x-small")


def save_grid(path: Path, panels: int, draw: Any, columns: int = 3) -> None:
    """A PNG of ``panels`` subplots, ``columns`` to a row; ``draw(list_of_axes)`` fills them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-panels // columns)
    width = min(columns, panels)
    figure, axes = plt.subplots(rows, width, figsize=(5.5 * width, 4.2 * rows), squeeze=False)
    flat = [axis for line in axes for axis in line]
    draw(flat[:panels])
    for axis in flat[panels:]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    print("report:", path)


def write_outputs(out: Path, report: dict[str, Any], host: HostQuiet | None = None) -> None:
    report = attach(report, host)
    write_report("report", json_safe(report), None, directory=out)
    cdf_panels = len(_cells_at(report, TARGET_LEVEL))
    if cdf_panels:
        save_grid(out / "ttft_cdf.png", cdf_panels, lambda axes: plot_cdfs(report, axes))
    swept = {cell_of(r) for r in report["rows"]
             if len({x["level"] for x in report["rows"] if cell_of(x) == cell_of(r)}) > 1}
    if swept:
        save_grid(out / "goodput_vs_load.png", len(swept), lambda axes: plot_goodput(report, axes))
    (out / "report.md").write_text(markdown(report))
