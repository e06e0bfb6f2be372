"""Scheduling: choose a pool and a worker for one request over a frozen fleet snapshot.

Pure and synchronous: no I/O, no await, no clock reads. Extension points are filters (drop candidates),
scorers (rate candidates in [0, 1]) and pickers (choose from the weighted totals), all from one registry by
name (``registry``); a ``Scheduler`` is a list of filters, a weighted list of scorers and a picker.
A request is first profiled (``estimate``: tokens, task class, affinity keys), then picked. With
``scheduling.debug_header`` the upstream request carries ``x-poolgate-decision`` (worker, task class, token
estimates and each scorer's score); log it with ``%REQ(X-POOLGATE-DECISION)%`` in an Envoy access-log format
or read it in the worker's request log.
"""

from extproc.scheduling.estimate import RequestProfiler, build_profiler
from extproc.scheduling.plugins import (
    Decision,
    Filter,
    NoCapacity,
    Outcome,
    PickContext,
    Picker,
    PickRequest,
    Refusal,
    Scorer,
)
from extproc.scheduling.registry import PLUGINS, Registry, build_scheduler, default_scheduler
from extproc.scheduling.scheduler import Scheduler

__all__ = ["PLUGINS", "Decision", "Filter", "NoCapacity", "Outcome", "PickContext", "PickRequest", "Picker",
           "Refusal", "Registry", "RequestProfiler", "Scheduler", "Scorer", "build_profiler", "build_scheduler",
           "default_scheduler"]
