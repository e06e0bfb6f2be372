"""How fair the priority queue is across N extproc processes (a pure simulation over ``FlowQueue`` and
``QueueOrder``, the code extproc runs).

Each process has its own queue; Envoy spreads requests over the processes (uniformly at random here), and
each process may use a 1/N share of a worker's unreserved room (``reservations``), so a freed unit of
capacity goes to a random process, which releases its queue's next candidate. "Fair across processes" is
the single-queue promise measured over all of them: within a priority class, each backlogged tenant gets
its weight's share of the tokens served; a lower class is served only while no higher-class request waits.

Two orders are compared: ``local`` (each process keeps class order only in its own queue) and ``shared``
(``queue_order``: each process reports the best class it holds waiting, the others see the report ``lag``
releases later, and a process whose candidate is outranked elsewhere leaves its unit of room free; the
room is split again at the next release, so a deferred unit goes to a random process then). Requests here
have no deadline, so the near-deadline exemption never applies. The run reports, for N = 1, 2, 4 and 8 and
two loads, the largest gap between a tenant's share of tokens served and its weight share, the share of
lower-class releases made while a class-0 request waited in some process (a priority inversion), how many
releases a class-0 request waited on average (with one queue: the releases until its turn), and the freed
units used per release (1.0: no room left idle).

    .venv/bin/python bench/fair_shares.py [--releases 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import host_quiet
from bench.report import write_report
from extproc.flow_queue import FlowQueue
from extproc.queue_order import QueueOrder
from poolgate.kernel.config import PoolSpec

TENANTS = {"gold": 3.0, "silver": 1.0, "bronze": 1.0}
"""Weights inside one class: ideal token shares 60 %, 20 %, 20 % while all three are backlogged."""
LOADS = {"deep": {"gold": 1.0, "silver": 1.0, "bronze": 1.0},
         "shallow": {"gold": 0.7, "silver": 0.2, "bronze": 0.2}}
"""Requests each tenant offers per release: every tenant far above its share (deep backlogs everywhere), or
only gold above its share and the others at theirs (their queues are often empty in some processes)."""
ORDERS = {"local": None, "shared lag 1": 1, "shared lag 10": 10}
"""Class order per process only, or shared with reports seen this many releases late (a release every few
tens of milliseconds, as LLM requests end, makes the ~0.1 s report delay about one release)."""
DOMAIN: tuple[str, None, frozenset[str]] = ("model", None, frozenset())
POOLS = (PoolSpec(name="pool", model="model"),)
NO_DEADLINE = 1e12


def simulate(processes: int, offered: dict[str, float], releases: int, lag: int | None = None,
             seed: int = 7) -> dict[str, float]:
    rng = random.Random(seed)
    step = [0]
    queues = [FlowQueue((NO_DEADLINE, NO_DEADLINE), 1_000_000, lambda: float(step[0])) for _ in range(processes)]
    orders = [QueueOrder(POOLS, queue.best_waiting, clock=lambda: 0.0) for queue in queues]
    reports: deque[list[dict[str, int]]] = deque(maxlen=(lag or 0) + 1)
    served = dict.fromkeys(TENANTS, 0)
    inversions = lower_releases = used = 0
    room = 0
    urgent_waits: list[float] = []
    for step[0] in range(releases):
        for tenant, rate in offered.items():
            arrivals = int(rate) + (rng.random() < rate - int(rate))
            for _ in range(arrivals):
                priority = 0 if rng.random() < 0.05 else 1
                rng.choice(queues).push(DOMAIN, tenant, priority, rng.randint(100, 2_000), TENANTS[tenant])
        if lag is not None:
            reports.append([order.report() for order in orders])
            seen = reports[0]  # what the processes read ``lag`` releases ago
            for index, order in enumerate(orders):
                order.apply(_best(r for i, r in enumerate(seen) if i != index))
        room += 1  # a unit of room freed, then (and every unit left free) offered to a random process's share
        for _ in range(room):
            index = rng.randrange(processes)
            queue = queues[index]
            entry = queue.next_candidate()
            if entry is None:
                room -= 1
                continue
            usable, outranked = orders[index].outranked(entry.domain, entry.priority)
            if lag is not None and usable and len(outranked) == len(usable) and not queue.is_urgent(entry):
                continue  # left free for a higher class waiting elsewhere
            room -= 1
            used += 1
            queue.take(entry)
            if entry.priority == 0:
                urgent_waits.append(step[0] - entry.enqueued_at)
                continue
            served[entry.tenant] += entry.tokens
            lower_releases += 1
            if any(q.depth().get((0, t), 0) for q in queues for t in TENANTS):
                inversions += 1
    total = sum(served.values()) or 1
    weight_total = sum(TENANTS.values())
    return {"processes": processes, "max_share_gap": max(abs(served[t] / total - TENANTS[t] / weight_total)
                                                         for t in TENANTS),
            **{f"share_{t}": served[t] / total for t in TENANTS},
            "inversion_share": inversions / lower_releases if lower_releases else 0.0,
            "urgent_wait_releases": sum(urgent_waits) / len(urgent_waits) if urgent_waits else 0.0,
            "used_per_release": used / releases}


def _best(reports: Any) -> dict[str, int]:
    best: dict[str, int] = {}
    for report in reports:
        for pool, priority in report.items():
            best[pool] = min(priority, best.get(pool, priority))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", type=int, default=20_000)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with host_quiet.measure() as quiet:
        for load, offered in LOADS.items():
            for order, lag in ORDERS.items():
                for processes in (1, 2, 4, 8):
                    rows.append({"load": load, "order": order, **simulate(processes, offered, args.releases, lag)})
    print(f"{'load':>8} {'order':>13} {'N':>2} {'gold':>6} {'silver':>6} {'bronze':>6} {'max gap':>7} "
          f"{'inversions':>10} {'class-0 wait':>12} {'room used':>9}")
    for r in rows:
        print(f"{r['load']:>8} {r['order']:>13} {r['processes']:>2} {r['share_gold']:>6.1%} "
              f"{r['share_silver']:>6.1%} {r['share_bronze']:>6.1%} {r['max_share_gap']:>7.1%} "
              f"{r['inversion_share']:>10.1%} {r['urgent_wait_releases']:>12.2f} {r['used_per_release']:>9.3f}")
    write_report("fair_shares", {"tenants": TENANTS, "releases": args.releases, "rows": rows}, host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
