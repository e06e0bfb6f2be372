"""This node's dcgm-exporter: its ``/metrics`` page, parsed with prometheus_client's text parser."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from agent.gpu_sources.dcgm_series import GPU_FIELDS, Series, reading_from_series
from agent.gpu_sources.polled import GpuSourceError, HttpText
from agent.gpu_sources.reading import GpuReading


def parse_dcgm_page(text: str) -> GpuReading:
    """The GPUs on one exporter's page, all filed as this node's; raises ``GpuSourceError`` on a page that
    is not Prometheus text."""
    try:
        return reading_from_series(_gpu_series(text))
    except ValueError as exc:  # the parser's error for malformed exposition text
        raise GpuSourceError(f"not Prometheus text: {exc}") from exc


def _gpu_series(text: str) -> Iterator[Series]:
    for family in text_string_to_metric_families(text):
        if family.name in GPU_FIELDS:
            for sample in family.samples:
                yield Series(sample.name, sample.labels, float(sample.value))


class DcgmExporterReader:
    """One ``GET`` of the exporter's page per read."""

    def __init__(self, http: HttpText, url: str) -> None:
        self._http = http
        self.url = url

    async def read_once(self) -> GpuReading:
        status, text = await self._http.get(self.url)
        if status != 200:
            raise GpuSourceError(f"{self.url} answered HTTP {status}")
        return parse_dcgm_page(text)
