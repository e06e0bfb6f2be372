"""Keeps Python's garbage collector from pausing a busy poolgate process to walk objects it keeps for good.

A full collection walks every object the collector tracks. Right after its imports a poolgate process holds
about 80,000 (modules, classes, protobuf descriptors, pydantic schemas), none of which will ever be garbage;
walking them made each full collection of a controller serving 5,000 workers pause its event loop for
75-570 ms (53 such pauses in one minute on a loaded host, none of which freed anything), which made heartbeats
late and workers expire. ``gc.freeze()`` moves every object alive at that moment into a generation the
collector never walks; what the process makes afterwards is collected as before (objects are still freed by
reference counting; only a cycle that includes a frozen object would be kept).

What the process builds later is a million objects more at 10,000 workers (records, endpoints, connections,
probe state). The objects that come and go around them made a full collection every one to two seconds with
CPython's default thresholds (700, 10, 10), each walking all of it for 85 to 200 ms and finding nothing: a
worker's change waited behind it on its way to Envoy. A full collection now comes after ``FULL_EVERY``
collections of the middle generation instead of 10: a hundred times less often (minutes apart at 10,000
workers). Cyclic garbage that lives long enough to reach the oldest generation waits that long to be freed;
after 200 s at 10,000 workers the controller's RSS was 225 MiB, against 222 MiB with full collections ten
times as often (``poolgate bench scale --steady-s 200``), and one change's slowest time to Envoy in 60 fell
from 89-316 ms to 49-110 ms over six runs each.
"""

from __future__ import annotations

import gc

FULL_EVERY = 1000
"""Collections of the middle generation between full ones (CPython's default: 10)."""


def freeze_startup_objects() -> None:
    """Call once a long-running process has started (its imports done, its servers bound)."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
