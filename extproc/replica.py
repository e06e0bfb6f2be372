"""What one extproc replica keeps across its requests: the KV and prefill reservations, the affinity map, the
priority queue, and the class order it keeps with the other replicas.

The wiring builds it once (``server.serve``, or ``assembly.build_service`` for tests and benchmarks) and hands
each part to what uses it: the place stage (reservations, affinity), the hold stage (queue), the director
(queue order), and the peer exchange that shares them with the other replicas. No stage reaches into another
stage, or into the director, for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.affinity import AffinityMap
from extproc.flow_queue import FlowQueue
from extproc.placed_prefixes import PlacedPrefixes
from extproc.queue_order import QueueOrder
from extproc.reservations import ReservationBook
from poolgate.kernel.config import PoolSpec, SchedulingSettings, TenancySettings


def queue_deadlines(scheduling: SchedulingSettings, tenancy: TenancySettings) -> tuple[float, ...]:
    """Each priority class's longest wait in the queue, highest class first (its own, else the default)."""
    return tuple(scheduling.max_wait_s if c.max_wait_s is None else c.max_wait_s for c in tenancy.priority_classes)


@dataclass(frozen=True)
class ReplicaState:
    reservations: ReservationBook
    affinity: AffinityMap
    queue: FlowQueue
    queue_order: QueueOrder | None
    """The best class other replicas hold waiting per pool (None: no pools configured, this replica alone)."""
    placed_prefixes: PlacedPrefixes

    @classmethod
    def build(cls, scheduling: SchedulingSettings, tenancy: TenancySettings, pools: Sequence[PoolSpec] = (),
              timer: Callable[[], float] = time.perf_counter) -> ReplicaState:
        """``timer``: the monotonic clock of queue deadlines."""
        queue = FlowQueue(queue_deadlines(scheduling, tenancy), tenancy.max_queued, timer)
        return cls(ReservationBook(scheduling.reservation_settle_s, scheduling.kv_reserve_fraction),
                   AffinityMap(scheduling.affinity_max_entries), queue,
                   QueueOrder(pools, queue.best_waiting) if pools else None, PlacedPrefixes())
