"""The agent's GPU source as ``agent.gpu_source`` says (the one place that knows all of them)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.gpu_sources.dcgm import DcgmExporterReader
from agent.gpu_sources.nvml import NvmlSource
from agent.gpu_sources.polled import HttpText, PolledSource
from agent.gpu_sources.prometheus import PrometheusReader
from agent.gpu_sources.reading import GpuSource
from agent.gpus import GpuReader, open_gpus
from poolgate.kernel.config import AgentSettings

log = logging.getLogger("poolgate.agent.gpu_sources")


async def open_gpu_source(settings: AgentSettings, open_nvml: Callable[[str], GpuReader | None] = open_gpus,
                          clock: Callable[[], float] = time.monotonic) -> GpuSource | None:
    """None only for NVML off or unavailable (``open_gpus`` logs why); the HTTP sources always open, and a
    source that does not answer shows in the log when it is first read."""
    if settings.gpu_source == "dcgm":
        dcgm = settings.dcgm
        http = HttpText(dcgm.timeout_s)
        log.info("GPU facts from dcgm-exporter at %s every %g s", dcgm.url, dcgm.interval_s)
        return PolledSource(f"dcgm-exporter {dcgm.url}", DcgmExporterReader(http, dcgm.url).read_once,
                            dcgm.interval_s, http, clock)
    if settings.gpu_source == "prometheus":
        prometheus = settings.prometheus
        http = HttpText(prometheus.timeout_s)
        reader = PrometheusReader(http, prometheus.url, prometheus.selector, prometheus.node_label)
        log.info("GPU facts from Prometheus at %s every %g s: %s", prometheus.url, prometheus.interval_s,
                 reader.query)
        return PolledSource(f"Prometheus {prometheus.url}", reader.read_once, prometheus.interval_s, http, clock)
    nvml = await asyncio.to_thread(open_nvml, settings.nvml)  # a driver load may block
    return None if nvml is None else NvmlSource(nvml)
