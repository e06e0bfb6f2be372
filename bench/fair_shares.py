"""How fair the priority queue is across N extproc processes (a pure simulation over ``FlowQueue``).

Each process has its own queue; Envoy spreads requests over the processes (uniformly at random here), and
each process may use a 1/N share of a worker's unreserved room (``reservations``), so a freed unit of
capacity goes to a random process, which releases its queue's next candidate. "Fair across processes" is
the single-queue promise measured over all of them: within a priority class, each backlogged tenant gets
its weight's share of the tokens served; a lower class is served only while no higher-class request waits.
The run reports, for N = 1, 2, 4 and 8 and two loads, the largest gap between a tenant's share of tokens
served and its weight share, and the share of releases of a lower class while a higher-class request
waited in another process (a priority inversion across processes) and how many releases a class-0 request
waited on average (with one queue: the releases until its turn).

    .venv/bin/python bench/fair_shares.py [--releases 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report
from extproc.flow_queue import FlowQueue

TENANTS = {"gold": 3.0, "silver": 1.0, "bronze": 1.0}
"""Weights inside one class: ideal token shares 60 %, 20 %, 20 % while all three are backlogged."""
LOADS = {"deep": {"gold": 1.0, "silver": 1.0, "bronze": 1.0},
         "shallow": {"gold": 0.7, "silver": 0.2, "bronze": 0.2}}
"""Requests each tenant offers per release: every tenant far above its share (deep backlogs everywhere), or
only gold above its share and the others at theirs (their queues are often empty in some processes)."""


def simulate(processes: int, offered: dict[str, float], releases: int, seed: int = 7) -> dict[str, float]:
    rng = random.Random(seed)
    step = [0]
    queues = [FlowQueue((60.0, 60.0), 1_000_000, lambda: float(step[0])) for _ in range(processes)]
    served = dict.fromkeys(TENANTS, 0)
    inversions = lower_releases = 0
    urgent_waits: list[float] = []
    for step[0] in range(releases):
        for tenant, rate in offered.items():
            arrivals = int(rate) + (rng.random() < rate - int(rate))
            for _ in range(arrivals):
                priority = 0 if rng.random() < 0.05 else 1
                rng.choice(queues).push("model", tenant, priority, rng.randint(100, 2_000), TENANTS[tenant])
        queue = rng.choice(queues)  # a unit of room freed in this process's share
        entry = queue.next_candidate()
        if entry is None:
            continue
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
            "urgent_wait_releases": sum(urgent_waits) / len(urgent_waits) if urgent_waits else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", type=int, default=20_000)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for load, offered in LOADS.items():
        for processes in (1, 2, 4, 8):
            rows.append({"load": load, **simulate(processes, offered, args.releases)})
    print(f"{'load':>8} {'N':>2} {'gold':>6} {'silver':>6} {'bronze':>6} {'max gap':>7} {'inversions':>10} "
          f"{'class-0 wait':>12}")
    for r in rows:
        print(f"{r['load']:>8} {r['processes']:>2} {r['share_gold']:>6.1%} {r['share_silver']:>6.1%} "
              f"{r['share_bronze']:>6.1%} {r['max_share_gap']:>7.1%} {r['inversion_share']:>10.1%} "
              f"{r['urgent_wait_releases']:>12.2f}")
    write_report("fair_shares", {"tenants": TENANTS, "releases": args.releases, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
