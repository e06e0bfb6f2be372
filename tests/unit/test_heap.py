"""The collector settings of the long-running processes: full collections rarer, cyclic garbage still freed."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, weakref
from poolgate.kernel.heap import FULL_EVERY, freeze_startup_objects

class Node:
    pass

freeze_startup_objects()
freed = []
for _ in range(1000):  # cycles made after start-up, dropped at once
    a, b = Node(), Node()
    a.other, b.other = b, a
    weakref.finalize(a, freed.append, 1)
    del a, b
keep = [[i] for i in range(200_000)]  # allocations that drive the collector (no explicit gc.collect)
print(len(freed), gc.get_threshold()[2] == FULL_EVERY, gc.get_freeze_count() > 0)
"""


def test_cycles_made_after_start_up_are_still_collected_on_their_own() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    freed, rarer, frozen = out.stdout.split()
    assert int(freed) == 1000 and rarer == "True" and frozen == "True"
