"""The health monitor's counts as Prometheus series on the controller's ``/metrics``: how long a round takes
(at scale, the time in which a hung worker is found), how many probes fail, and what was judged out of turn."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.monitor import MonitorStats
from poolgate.kernel.fleet import WorkerState


class MonitorMetrics(Collector):
    """Reads ``MonitorStats`` at each scrape (nothing is counted twice, nothing on the probing path)."""

    def __init__(self, stats: MonitorStats, registry: CollectorRegistry) -> None:
        self._stats = stats
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        yield CounterMetricFamily("poolgate_health_rounds", "Health rounds this controller ran as leader.",
                                  value=stats.rounds)
        yield GaugeMetricFamily("poolgate_health_round_seconds",
                                "Duration of the last health round (every worker probed once).",
                                value=stats.last_round_s)
        yield GaugeMetricFamily("poolgate_fleet_expiry_held", "Workers past their heartbeat deadline kept "
                                "registered because too many were overdue at once (the registry's trouble, not "
                                "theirs); their probes decide whether they serve.", value=stats.expiry_held)
        yield CounterMetricFamily("poolgate_health_probes", "Health probes sent.", value=stats.probes)
        yield CounterMetricFamily("poolgate_health_probe_failures", "Health probes that failed (refused, an "
                                  "error status, no answer within the probe timeout).", value=stats.probe_failures)
        yield CounterMetricFamily("poolgate_health_slots_given_back", "Slow probes that gave their round slot back "
                                  "and waited on without one (a hung worker does not hold up the round).",
                                  value=stats.slots_given_back)
        yield CounterMetricFamily("poolgate_health_early_confirmations", "Probes sent to confirm a failure while "
                                  "the slow probe they confirm was still out (a hung worker leaves sooner).",
                                  value=stats.early_confirmations)
        out_of_turn = CounterMetricFamily("poolgate_health_out_of_turn", "Workers judged between rounds, by why: "
                                          "data_path (Envoy reported failed requests), hung_up (the worker closed "
                                          "its probe connection).", labels=["reason"])
        out_of_turn.add_metric(["data_path"], stats.out_of_turn)
        out_of_turn.add_metric(["hung_up"], stats.hung_up)
        yield out_of_turn
        transitions = CounterMetricFamily("poolgate_health_transitions", "Worker state changes the monitor wrote "
                                          "(every pair present from the start, at 0 until one happens).",
                                          labels=["from", "to"])
        for before, after in itertools.permutations([state.value for state in WorkerState], 2):
            transitions.add_metric([before, after], stats.transitions.get(f"{before}->{after}", 0))
        yield transitions
