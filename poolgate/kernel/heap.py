"""Keeps Python's garbage collector from pausing a busy poolgate process to walk objects it keeps for good.

A full collection walks every object the collector tracks. Right after its imports a poolgate process holds
about 80,000 (modules, classes, protobuf descriptors, pydantic schemas), none of which will ever be garbage;
walking them made each full collection of a controller serving 5,000 workers pause its event loop for
75-570 ms (53 such pauses in one minute on a loaded host, none of which freed anything), which made heartbeats
late and workers expire. ``gc.freeze()`` moves every object alive at that moment into a generation the
collector never walks; what the process makes afterwards is collected as before (objects are still freed by
reference counting; only a cycle that includes a frozen object would be kept).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Call once a long-running process has started (its imports done, its servers bound)."""
    gc.collect()
    gc.freeze()
