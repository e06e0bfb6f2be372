"""The heartbeat interval the registry hands each worker: stretched with the fleet, so the registry can always
afford the heartbeats it asks for.

A fixed interval makes the registry's load the fleet's size divided by a constant chosen for small fleets:
10,000 workers beating every 0.5 s ask for 20,000 calls a second, four times what one Python API process
serves. Nomad met this a decade ago with ``max_heartbeats_per_second``: the server answers every heartbeat with
the client's next TTL, stretched so that the whole cluster stays under that rate, with a floor and a grace.
Here, for a fleet of ``workers`` beating ``workers_per_call`` to a call (1: each worker its own call; a node
agent's batch: its node's workers) to a registry of ``api_processes`` processes that each afford
``calls_per_s_per_process``::

    interval = max(floor_s, workers / (workers_per_call × calls_per_s_per_process × api_processes))
    handed   = interval × (1 + jitter × u)                 u uniform in [0, 1): each worker its own phase
    ttl      = interval × (1 + jitter) + grace             grace = max(floor grace, interval), rounded up

``handed`` never falls below the interval, so the fleet's rate stays under the budget whatever ``u`` draws; the
jitter keeps a fleet that registered at once from beating in lock-step. The TTL covers the longest interval
handed at this size plus a grace: the configured one (``heartbeat_ttl_s − heartbeat_interval_s``), or one whole
interval once the interval has stretched, so a stretched fleet still survives one lost heartbeat. Each answer
carries its own TTL, so a fleet that shrinks gets shorter intervals at its next beat and none expires on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

JITTER = 0.25
"""Intervals are spread up to this share above the computed one."""
TTL_STEP_S = 0.25
"""TTLs are rounded up to a multiple of this, so the heartbeats of one write batch share a few TTLs (one Redis
command each), not one per fleet size they were answered at."""


@dataclass(frozen=True, slots=True)
class HeartbeatPace:
    """The registry's side of the rule: the configured floor and grace, and what it affords."""

    floor_s: float
    """The configured interval (``controller.heartbeat_interval_s``): no worker beats more often."""
    grace_s: float
    """The configured TTL's margin over the interval (``heartbeat_ttl_s − heartbeat_interval_s``)."""
    calls_per_s_per_process: float
    """Heartbeat calls one registry API process is asked to serve at most (``controller.max_heartbeats_per_s``)."""
    api_processes: int
    """Processes that serve the heartbeats (the controller itself counts as one)."""


@dataclass(frozen=True, slots=True)
class NextBeat:
    """What a registration or heartbeat is answered with: beat again within ``interval_s``; the registry
    forgets the worker ``ttl_s`` after this beat without another."""

    interval_s: float
    ttl_s: float


def fleet_interval_s(pace: HeartbeatPace, workers: int, workers_per_call: int = 1) -> float:
    """The interval before jitter: the floor, or longer once the fleet's calls would pass the budget."""
    calls_budget_per_s = pace.calls_per_s_per_process * max(1, pace.api_processes) * max(1, workers_per_call)
    return max(pace.floor_s, max(0, workers) / calls_budget_per_s)


def next_beat(pace: HeartbeatPace, workers: int, draw: float, workers_per_call: int = 1) -> NextBeat:
    """The answer for one heartbeat call in a fleet of ``workers``; ``draw`` in [0, 1) picks the jitter (the
    caller's random source, so that tests choose it)."""
    interval_s = fleet_interval_s(pace, workers, workers_per_call)
    ttl_s = interval_s * (1 + JITTER) + max(pace.grace_s, interval_s)
    return NextBeat(interval_s * (1 + JITTER * min(max(draw, 0.0), 1.0)),
                    math.ceil(round(ttl_s / TTL_STEP_S, 9)) * TTL_STEP_S)
