"""The metrics every poolgate process exports, read from the registries the code really builds.

``python -m poolgate.metrics_doc > docs/metrics.md`` writes the reference; the dashboard test uses
``exported_metrics`` to check that every series a Grafana query names exists. Building the registries
(not parsing source) means a renamed metric shows up here the moment the code changes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CollectorRegistry

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "info": ("_info",), "gauge": ("",)}
"""The series names Prometheus' text format gives each family type."""


@dataclass(frozen=True)
class MetricFamily:
    process: str
    name: str
    type: str
    help: str
    labels: tuple[str, ...]

    @property
    def series(self) -> tuple[str, ...]:
        return tuple(self.name + suffix for suffix in SUFFIXES.get(self.type, ("",)))


def _extproc() -> CollectorRegistry:
    from extproc.metrics import Metrics

    return Metrics().registry


def _controller() -> CollectorRegistry:
    from controller.autoscaler import Autoscaler
    from poolgate.config import parse_config

    registry = CollectorRegistry()
    config = parse_config({"pools": [{"name": "p", "model": "m"}]})
    # The constructor only registers its counter; the I/O parts it keeps are never touched here.
    Autoscaler(config, cast(Any, None), cast(Any, None), cast(Any, None), registry)
    return registry


def _simworker() -> CollectorRegistry:
    from controller.simworker.metrics import WorkerMetrics

    return WorkerMetrics("model", {"block_size": "16", "num_gpu_blocks": "1000"}, 80e9, legacy_kv_metric=True).registry


PROCESSES = {
    "extproc": (_extproc, "`poolgate extproc --metrics-port P`, `/metrics`"),
    "controller": (_controller, "the controller's HTTP API port, `/metrics` (no token needed)"),
    "simworker": (_simworker, "each simulated worker's port, `/metrics` (vLLM's names; a real `vllm serve` "
                              "exports these vLLM series and more)"),
}


def _label_names(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    # prometheus_client keeps the declared label names only on the collector objects; families without
    # children yet have no samples to read them from.
    names: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        name = getattr(collector, "_name", None)
        if name is not None:
            names[name] = tuple(getattr(collector, "_labelnames", ()))
    for family in registry.collect():
        for sample in family.samples:
            names[family.name] = tuple(sorted(set(names.get(family.name, ())) | set(sample.labels) - {"le"}))
    return names


def exported_metrics() -> list[MetricFamily]:
    found = []
    for process, (build, _) in PROCESSES.items():
        registry = build()
        labels = _label_names(registry)
        for family in registry.collect():
            found.append(MetricFamily(process, family.name, family.type, family.documentation,
                                      labels.get(family.name, ())))
    return sorted(found, key=lambda f: (f.process, f.name))


def exported_series() -> set[str]:
    """Every series name a scrape can show (``_total``, ``_bucket`` … included)."""
    return {series for family in exported_metrics() for series in family.series}


def render() -> str:
    lines = ["# Metrics reference", "",
             "Generated from the registries the code builds: `python -m poolgate.metrics_doc > docs/metrics.md`",
             "(a test fails when this file is stale). Counters are exported with `_total`, histograms as",
             "`_bucket`, `_sum` and `_count`. The Grafana dashboard in `deploy/grafana/` uses only these series",
             "and the GPU series of NVIDIA's dcgm-exporter.", ""]
    families = exported_metrics()
    for process, (_, where) in PROCESSES.items():
        lines += [f"## {process}", "", f"Scraped from {where}.", "",
                  "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for family in (f for f in families if f.process == process):
            labels = ", ".join(f"`{label}`" for label in family.labels) or "–"
            meaning = family.help.replace("|", "\\|")
            lines.append(f"| `{family.name}` | {family.type} | {labels} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
