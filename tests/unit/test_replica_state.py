"""The replica's state is the one its stages use: what the place stage records is what the peer exchange shares
with the other extproc processes, from the first request on (an empty affinity map included)."""

from __future__ import annotations

from types import SimpleNamespace

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.pipeline.place import Place
from extproc.replica import ReplicaState
from extproc.scheduling import Decision, build_scheduler
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import SchedulingSettings, TenancySettings
from tests.unit.test_latency_model import NOW, POOLS, PROMPT, lookup_over, pick_request
from tests.unit.test_latency_model import worker as publishing_worker


def test_a_placement_lands_in_the_replicas_shared_reservations_and_affinity() -> None:
    settings = SchedulingSettings()
    replica = ReplicaState.build(settings, TenancySettings())
    workers = [publishing_worker("only")]
    lookup = lookup_over(workers, {})
    fleet = SimpleNamespace(snapshot=build_snapshot(workers, POOLS, NOW, 3.0))
    place = Place(build_scheduler(settings), fleet, InflightTracker(), Metrics(), settings, clock=lambda: NOW,
                  prefix_cache=lookup, reservations=replica.reservations, affinity=replica.affinity)
    request = pick_request({"model": "llama", "prompt": PROMPT}, lookup)
    decision = place.pick(request, None)
    assert isinstance(decision, Decision)
    place.commit(request, decision)
    assert replica.reservations.own_prefill_tokens.get("only") == len(PROMPT)
    assert place.affinity is replica.affinity and place.reservations is replica.reservations
