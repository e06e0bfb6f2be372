"""The ``agent`` section: how often the node agent scrapes, and where its GPU facts come from."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from poolgate.kernel.config.base import Section

_LABEL_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*'


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return url


class DcgmExporterSettings(Section):
    """This node's NVIDIA dcgm-exporter, read by the agent when ``agent.gpu_source`` is ``dcgm``."""

    url: str = "http://127.0.0.1:9400/metrics"
    """The exporter's ``/metrics`` page on this node. On Kubernetes: the node's address and the exporter's
    hostPort, or a Service with ``internalTrafficPolicy: Local`` (docs/gpu-workers.md)."""
    timeout_s: float = Field(1.0, gt=0, le=30)
    interval_s: float = Field(1.0, gt=0, le=300)
    """Seconds between reads of the page (dcgm-exporter samples every 30 s unless started with ``-c MS``)."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)


class PrometheusGpuSettings(Section):
    """A Prometheus server that scrapes dcgm-exporter, queried when ``agent.gpu_source`` is ``prometheus``:
    one query per read for every GPU it knows."""

    url: str = ""
    """The server's base URL, e.g. ``http://prometheus.monitoring:9090`` (``/api/v1/query`` is added)."""
    selector: str = ""
    """Extra label matchers for the query, e.g. ``job="dcgm-exporter"`` (PromQL syntax, comma-separated)."""
    node_label: str = "Hostname"
    """The label that names a GPU's node, matched against the worker's ``node`` (dcgm-exporter's own)."""
    timeout_s: float = Field(2.0, gt=0, le=30)
    interval_s: float = Field(5.0, gt=0, le=300)
    """Seconds between queries; below Prometheus's scrape interval for the exporter nothing new is learned."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url) if url else url

    @field_validator("selector")
    @classmethod
    def _matchers(cls, selector: str) -> str:
        if selector.strip() and not re.fullmatch(f"{_LABEL_MATCHER}(,{_LABEL_MATCHER})*,?\\s*", selector):
            raise ValueError(f"{selector!r} is not a list of PromQL label matchers, e.g. job=\"dcgm-exporter\"")
        return selector


class AgentSettings(Section):
    scrape_interval_s: float = Field(0.25, gt=0, le=5)
    """How often the agent reads each worker's /metrics and the GPUs (≤ 0.25 s keeps picks current)."""
    nvml: Literal["auto", "off"] = "auto"
    """``auto``: read GPUs through NVML when a driver is present, else use only the workers' metrics."""
    gpu_source: Literal["nvml", "dcgm", "prometheus"] = "nvml"
    """Where GPU memory and utilisation come from: NVML on the node (``nvml`` setting above), this node's
    dcgm-exporter (``dcgm``), or a Prometheus server that scrapes the exporters (``prometheus``)."""
    dcgm: DcgmExporterSettings = DcgmExporterSettings()
    prometheus: PrometheusGpuSettings = PrometheusGpuSettings()

    @model_validator(mode="after")
    def _prometheus_has_url(self) -> AgentSettings:
        if self.gpu_source == "prometheus" and not self.prometheus.url:
            raise ValueError("gpu_source prometheus needs prometheus.url, e.g. http://prometheus:9090")
        return self
