"""Every series and label the Grafana dashboard queries exists in the registries the processes build.

A renamed metric, a typo in a query or a label a metric does not carry fails here, not on a blank panel."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from poolgate.metrics_doc import exported_metrics, render

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "poolgate.json").read_text())

DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION",
               "container", "namespace", "pod")
EXTERNAL = {"DCGM_FI_DEV_GPU_UTIL": DCGM_LABELS, "DCGM_FI_DEV_FB_USED": DCGM_LABELS}
"""NVIDIA dcgm-exporter's default counters (real GPUs); not poolgate's to export."""
TARGET_LABELS = {"instance", "job", "le", "namespace", "pod"}
"""Labels Prometheus adds at scrape time (and ``le`` of histogram buckets)."""
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


def series_labels() -> dict[str, set[str]]:
    labels: dict[str, set[str]] = {name: set(found) for name, found in EXTERNAL.items()}
    for family in exported_metrics():
        for series in family.series:
            labels[series] = set(family.labels)
    return labels


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def metric_names(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, labels matched in its selector) for every metric a PromQL expression names."""
    text = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    found = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", text):
        name, selector, call = match.groups()
        if call or name.lower() in PROMQL_WORDS:
            continue  # a function, or a keyword
        found.append((name, set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=|!=|=~|!~)\s*\"", selector or ""))))
    return found


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    return labels


def test_query_parser_finds_metrics_and_labels() -> None:
    expr = 'histogram_quantile(0.95, sum by (le, pool) (rate(poolgate_x_bucket{pool=~"$pool", a!="b"}[5m])))'
    assert metric_names(expr) == [("poolgate_x_bucket", {"pool", "a"})]
    assert grouping_labels(expr) == {"le", "pool"}


@pytest.mark.parametrize("expr", queries(DASHBOARD))
def test_every_queried_series_is_exported(expr: str) -> None:
    known = series_labels()
    variable = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_]+)\)", expr)  # a Grafana variable's query
    if variable:
        expr = f"sum by ({variable.group(2)}) ({variable.group(1)})"
    names = metric_names(expr)
    assert names, f"no metric found in {expr!r}"
    for name, matched in names:
        assert name in known, f"{name} is not exported by any poolgate process (see docs/metrics.md)"
        assert matched <= known[name] | TARGET_LABELS, f"{name} has no label {matched - known[name]}"
    available = set().union(*(known[name] for name, _ in names)) | TARGET_LABELS
    assert grouping_labels(expr) <= available, f"grouping by a label no queried metric has: {expr}"


def test_a_typo_is_caught() -> None:
    assert "poolgate_extproc_pick_second_bucket" not in series_labels()
    [(name, _)] = metric_names("rate(poolgate_extproc_pick_second_bucket[5m])")
    assert name == "poolgate_extproc_pick_second_bucket"


def test_dashboard_covers_each_area() -> None:
    rows = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "GPU and KV cache", "Decisions", "Queue", "Tenants and quotas", "Autoscaler",
                    "Health monitor"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]


def test_metrics_reference_is_current() -> None:
    assert (ROOT / "docs" / "metrics.md").read_text() == render(), (
        "docs/metrics.md is stale: run `python -m poolgate.metrics_doc > docs/metrics.md`")
