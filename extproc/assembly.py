"""Assembles one servicer from its parts: the director and its stages, each given the section it reads.

``server.serve`` calls it with the process's real parts; tests and the micro-benchmark with their own.
Parts left out get the neutral choice: no tenants (everyone is the default tenant), no quotas, an empty
catalogue, GenAI metrics off.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

from extproc.catalogue import EMPTY_CATALOGUE
from extproc.catalogue_source import CatalogueSource
from extproc.disagg import DisaggPlan
from extproc.inflight import InflightTracker
from extproc.kvcache.lookup import CacheLookup
from extproc.metrics import Metrics
from extproc.output_lengths import OutputLengths
from extproc.pipeline import (
    Admit,
    CapacitySignal,
    Director,
    Hold,
    Identify,
    Place,
    Resolve,
    Respond,
    SnapshotSource,
)
from extproc.pipeline.cold_start import ColdStarts
from extproc.quota import QuotaStore
from extproc.replica import ReplicaState, queue_deadlines
from extproc.scheduling import RequestProfiler, Scheduler
from extproc.service import ExtProcService
from extproc.siblings import Siblings
from extproc.tenancy import TenantDirectory
from poolgate.kernel.config import PoolSpec, PoolTask, SchedulingSettings, TenancySettings


def build_service(
    scheduler: Scheduler,
    fleet: SnapshotSource,
    inflight: InflightTracker,
    metrics: Metrics,
    *,
    max_request_bytes: int,
    scheduling: SchedulingSettings | None = None,
    profiler: RequestProfiler | None = None,
    tenants: TenantDirectory | None = None,
    quotas: QuotaStore | None = None,
    catalogue: CatalogueSource | None = None,
    capacity_changed: CapacitySignal | None = None,
    genai_metrics: bool = False,
    header_pin: bool = False,
    clock: Callable[[], float] = time.time,
    timer: Callable[[], float] = time.perf_counter,
    rng: random.Random | None = None,
    model_tasks: Mapping[str, PoolTask] | None = None,
    prefix_cache: CacheLookup | None = None,
    disagg: DisaggPlan | None = None,
    cold_starts: ColdStarts | None = None,
    pools: Sequence[PoolSpec] = (),
    replica: ReplicaState | None = None,
    queue_changed: Callable[[], None] | None = None,
    siblings: Siblings | None = None,
) -> ExtProcService:
    """``clock`` is the wall clock worker records are stamped with; ``timer`` the monotonic one for durations
    and queue deadlines; ``rng`` draws catalogue traffic splits; ``model_tasks`` says what each served model
    does (from the pools), so an endpoint its kind does not serve is refused before routing; ``disagg`` names
    the models whose long prompts are split over a prefill and a decode worker; ``cold_starts`` the pools that may
    scale to zero (a request finding them empty waits for a worker); with ``pools`` (the configured ones) the
    director keeps class order with other replicas (``queue_order``, fed by the peer exchange). ``replica`` is the
    state kept across requests (reservations, affinity, queue, queue order) that the caller also hands to the
    peer exchange; left out, it is built here. ``queue_changed`` is called when a request joins or leaves the
    queue. ``siblings``: the other extproc processes of this host (``extproc.siblings``)."""
    scheduling = scheduling or SchedulingSettings()
    tenants = tenants or TenantDirectory(TenancySettings(), ())
    tenancy = tenants.settings
    replica = replica or ReplicaState.build(scheduling, tenancy, pools, timer)
    hold = Hold(queue_deadlines(scheduling, tenancy), replica.queue, metrics, timer, capacity_changed)
    if queue_changed is not None:
        hold.on_queue_change(queue_changed)
    director = Director(
        identify=Identify(tenants, max_request_bytes),
        resolve=Resolve(catalogue or CatalogueSource(EMPTY_CATALOGUE), profiler or RequestProfiler(scheduling),
                        rng or random.Random(), model_tasks),
        admit=Admit(quotas, tenancy, metrics),
        hold=hold,
        place=Place(scheduler, fleet, inflight, metrics, scheduling, clock, timer, prefix_cache, disagg,
                    reservations=replica.reservations, affinity=replica.affinity, siblings=siblings,
                    placed_prefixes=replica.placed_prefixes),
        respond=Respond(metrics, genai_metrics),
        metrics=metrics, clock=clock, timer=timer, lengths=_output_lengths(scheduling), cold_starts=cold_starts,
        queue_order=replica.queue_order)
    hold.capacity_changed.subscribe(lambda: hold.request_pass(director))
    return ExtProcService(director, metrics, header_pin=header_pin)


def _output_lengths(scheduling: SchedulingSettings) -> OutputLengths | None:
    learned = scheduling.learned_output
    if not learned.enabled:
        return None
    return OutputLengths(learned.quantile, learned.window, learned.min_samples, learned.tenant_min_samples,
                         learned.sample_every)
