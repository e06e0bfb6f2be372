"""Shared output of the benchmarks: a printed table, a JSON file and a PNG plot per run.

Reports go to ``bench/reports/<name>.json`` and ``.png``; the JSON keeps every row and the run's
parameters so a later run can be compared without re-running this one. ``write_report`` takes any
JSON-shaped report and a plotting callback; ``save_rows`` is the common case of a table of rows
plotted against one column. Both take the run's ``host`` measurement (``bench.host_quiet``), so a figure
never travels without how quiet the host was when it was taken.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.host_quiet import HostQuiet, attach, describe

REPORTS_DIR = Path(__file__).resolve().parent / "reports"
Row = Mapping[str, float | int | str | None]
PlotFunction = Callable[[Any, Any], None]


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{:.2f}"


@dataclass(frozen=True)
class Panel:
    """One subplot: these row keys against the report's x key."""

    title: str
    y_keys: tuple[str, ...]
    y_label: str
    log_y: bool = False


def parse_out_args(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                   argv: Sequence[str] | None) -> tuple[argparse.Namespace, Path]:
    """A benchmark's options (``add_arguments``, described by its docstring's first line) and its ``--out``
    directory, created."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def write_report(name: str, report: Any, plot: PlotFunction | None = None, *, panels: int = 1,
                 directory: Path = REPORTS_DIR, host: HostQuiet | None = None) -> Path:
    """Write ``<name>.json`` and, given ``plot(report, axes)``, ``<name>.png``; returns the JSON path.

    ``axes`` is one matplotlib Axes, or a list of ``panels`` Axes side by side when ``panels`` > 1. The
    report gets its ``"host"`` section here (``host_quiet.attach``: without ``host`` it says "not measured"
    unless it holds one already), and its one-line verdict is printed.
    """
    report = attach(report, host)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    written = [json_path]
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
        plot(report, axes[0][0] if panels == 1 else list(axes[0]))
        figure.suptitle(name)
        figure.tight_layout()
        png_path = directory / f"{name}.png"
        figure.savefig(png_path, dpi=100)
        plt.close(figure)
        written.append(png_path)
    print("report:", " and ".join(str(path) for path in written))
    if isinstance(report, Mapping):
        print(describe(report.get("host")))
    return json_path


def format_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    cells = [[column.header for column in columns]]
    cells += [[_cell(row.get(column.key), column.fmt) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(value.rjust(width) for value, width in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def save_rows(name: str, rows: Sequence[Row], columns: Sequence[Column], *, x_key: str,
              panels: Sequence[Panel], parameters: Mapping[str, object], host: HostQuiet | None = None) -> Path:
    """Print ``rows`` as a table and write them, with one subplot per panel against ``x_key``."""
    print(format_table(rows, columns))

    def plot(report: Mapping[str, Any], axes: list[Any]) -> None:
        xs = [row[x_key] for row in report["rows"]]
        for axis, panel in zip(axes, panels, strict=True):
            for key in panel.y_keys:
                axis.plot(xs, [_number(row.get(key)) for row in report["rows"]], marker="o", label=key)
            axis.set_title(panel.title)
            axis.set_xlabel(x_key)
            axis.set_ylabel(panel.y_label)
            if panel.log_y:
                axis.set_yscale("log")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize="small")

    report = {"name": name, "parameters": dict(parameters), "rows": [dict(row) for row in rows]}
    return write_report(name, report, plot if len(panels) > 1 else lambda r, a: plot(r, [a]),
                        panels=max(1, len(panels)), host=host)


def plot_ttft_cdf(axis: Any, samples: Sequence[float], sent: int, label: str) -> None:
    """Share of all sent requests with a first token by time t: requests without one keep the curve below 1."""
    if samples:
        axis.plot(samples, [(i + 1) / max(1, sent) for i in range(len(samples))], label=label)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _cell(value: object, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value) if isinstance(value, int | float) else str(value)
