"""The xDS server's counts as Prometheus series on the controller's ``/metrics``: snapshots it refused to
publish (Envoy kept the last good one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class RefusedSnapshots(Protocol):
    """What the collector reads (``XdsServer``)."""

    @property
    def snapshots_refused(self) -> int: ...


class XdsMetrics(Collector):
    """Reads the xDS server's counts at each scrape (nothing on the publishing path)."""

    def __init__(self, xds: RefusedSnapshots, registry: CollectorRegistry) -> None:
        self._xds = xds
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("poolgate_xds_snapshots_refused", "xDS snapshots not published because they did "
                                  "not hold together (a route's cluster not served, a cluster without its load "
                                  "assignment or one without its cluster); Envoy keeps the last good one. Any is "
                                  "a bug in the build.", value=self._xds.snapshots_refused)
