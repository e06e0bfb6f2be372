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
    from controller.monitor import MonitorStats
    from controller.monitor_metrics import MonitorMetrics
    from controller.xds.metrics import XdsMetrics
    from controller.xds.xds_server import XdsServer
    from poolgate.kernel.config import parse_config

    registry = CollectorRegistry()
    config = parse_config({"pools": [{"name": "p", "model": "m"}]})
    # The constructor only registers its counter; the I/O parts it keeps are never touched here.
    Autoscaler(cast(Any, None), config.autoscale, cast(Any, None), registry)
    MonitorMetrics(MonitorStats(), registry)
    XdsMetrics(XdsServer(config.pools), registry)
    return registry


def _simworker() -> CollectorRegistry:
    from simworker.metrics import WorkerMetrics

    return WorkerMetrics("model", {"block_size": "16", "num_gpu_blocks": "1000"}, 80e9, legacy_kv_metric=True).registry


GENAI_SERIES = (
    ("gen_ai.client.token.usage", "gen_ai_client_token_usage",
     "input and output tokens of each request whose response reported `usage`"),
    ("gen_ai.server.request.duration", "gen_ai_server_request_duration_seconds",
     "every inference request; `error_type` when it failed"),
    ("gen_ai.server.time_to_first_token", "gen_ai_server_time_to_first_token_seconds",
     "streamed requests that succeeded"),
    ("gen_ai.server.time_per_output_token", "gen_ai_server_time_per_output_token_seconds",
     "streamed requests that succeeded with ≥ 2 output tokens"),
)
GENAI_ATTRIBUTES = (
    ("gen_ai.operation.name", "`chat` (`/v1/chat/completions`, `/v1/responses`), `text_completion` "
                              "(`/v1/completions`), `embeddings` (`/v1/embeddings`), empty for the other endpoints"),
    ("gen_ai.provider.name", "`openai`: the API the workers speak (the attribute was `gen_ai.system` up to "
                             "conventions v1.36)"),
    ("gen_ai.request.model", "the model the client asked for; empty for a name neither the catalogue nor the "
                             "fleet knows"),
    ("gen_ai.response.model", "the name the worker was sent and answers with (a catalogue version's served "
                              "name); empty when the request was not placed"),
    ("gen_ai.token.type", "`input` or `output`"),
    ("error.type", "extproc's error code (`no_capacity`, `queue_full`, `invalid_api_key` …, as in "
                   "`poolgate_extproc_requests`), the worker's HTTP status (`500` …), `stream_error` (a stream "
                   "that had begun carried the worker's error event, as vLLM sends one when generation fails "
                   "after its 200) or `incomplete` (the stream closed before the last byte); empty on success"),
)
GENAI_INTRO = """\
The four `gen_ai_*` histograms follow the OpenTelemetry GenAI semantic conventions for metrics, named the way
OpenTelemetry's Prometheus translation names them: dots become underscores in metric and attribute names,
the unit `s` adds `_seconds`, the `{token}` annotation adds nothing. Bucket boundaries are the ones the
conventions recommend, so queries written against these names elsewhere carry over.
"""
GENAI_PROSE = """\
extproc measures from its seat in front of the workers, from the moment it sees the request headers: time
to first token includes poolgate's queueing and holding for capacity, the trip to the worker and the
engine's own queue and prefill (the engine's share alone is `vllm:time_to_first_token_seconds`). The first
token is the first response chunk whose content, text, reasoning or tool call is non-empty (a role-only first
event does not count). Time per output token is (last chunk − first output chunk) / (output tokens − 1),
with the output tokens from the usage block. A non-streamed answer arrives whole, its first byte being its
last: it records duration and token usage only. `server.address` and `server.port` are left out (a series
per worker for every bucket; `poolgate_extproc_picks` counts placements per worker).

They are recorded only with `observability.genai_metrics` on (off by default; on in `deploy/local.yaml` and
the Kubernetes config): every inference response then passes through extproc chunk by chunk (one ext_proc
message per streamed chunk, extproc CPU), and streaming requests get `stream_options.include_usage` added,
with the extra usage chunk hidden from clients that did not ask for it. Chunks are searched for bytes, never
parsed; only the usage block is, once per response.
"""


def genai_section() -> list[str]:
    """How the OpenTelemetry GenAI conventions map onto extproc's ``gen_ai_*`` series."""
    lines = ["### OpenTelemetry GenAI names", "", GENAI_INTRO,
             "| OpenTelemetry metric | Prometheus series | recorded |", "|---|---|---|"]
    lines += [f"| `{otel}` | `{prometheus}` | {when} |" for otel, prometheus, when in GENAI_SERIES]
    lines += ["", "| attribute | label | value |", "|---|---|---|"]
    lines += [f"| `{name}` | `{name.replace('.', '_')}` | {value} |" for name, value in GENAI_ATTRIBUTES]
    return [*lines, "", GENAI_PROSE]


def _pd_sidecar() -> CollectorRegistry:
    from extproc.sidecar import SidecarMetrics

    return SidecarMetrics().registry


PROCESSES = {
    "extproc": (_extproc, "`poolgate extproc --metrics-port P` (or `observability.extproc_metrics_port`), "
                          "`/metrics`"),
    "controller": (_controller, "the controller's HTTP API port, `/metrics` (no token needed)"),
    "pd-sidecar": (_pd_sidecar, "`poolgate pd-sidecar`'s port, `/metrics` (a config with `role: prefill` pools)"),
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
        if process == "extproc":
            lines += genai_section()
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
