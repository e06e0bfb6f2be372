"""Scheduling: choose a pool and a worker for one request over a frozen fleet snapshot.

Pure and synchronous: no I/O, no await, no clock reads. Extension points are filters (drop candidates)
and scorers (rate candidates in [0, 1]); a ``Scheduler`` is a list of filters and a weighted list of scorers.
"""

from extproc.scheduling.plugins import Decision, Filter, PickContext, Scorer
from extproc.scheduling.scheduler import Scheduler, default_scheduler

__all__ = ["Decision", "Filter", "PickContext", "Scheduler", "Scorer", "default_scheduler"]
