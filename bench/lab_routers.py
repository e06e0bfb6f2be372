"""The routers the lab compares: poolgate's own scheduling code, and the reference policies, each
implemented from its published algorithm and defaults.

Every router sees what it would see in production and nothing more: the request (body and, for the
routers that tokenise, the engine's token ids), its own record of what it sent where, and where it
subscribes to them, the worker records (``on_records``) and the KV events (``on_kv_events``). Only the
oracle looks inside the engines.

- ``poolgate``: the product's request path without its sockets: the profiler, learned output lengths,
  ``Place`` (the scheduler over the snapshot, in-flight counts, reservations, affinity, the KV-event index),
  holding a request that fits nowhere until ``scheduling.max_wait_s``. With ``processes`` > 1, requests are
  dealt to N replicas that exchange reservations, in-flight counts and affinity every ``exchange_s``, as
  through Redis; with ``siblings``, as the processes of one host do (``extproc.siblings``): before every pick,
  with each placement's pending prompt blocks, and the book's unseen window ``SIBLING_EXCHANGE_S``.
- ``least_request``: the fewest requests in flight (the router's own count), ties at random; Envoy's
  ``least_request`` with all hosts as choices.
- ``power_of_two``: two workers at random, the one with fewer in flight.
- ``cache_aware``: sglang-router's and vllm-router's policy with their defaults (cache_threshold 0.3,
  balance_abs_threshold 64, balance_rel_threshold 1.5): when the load (requests in flight, the router's own
  count) is imbalanced, max − min > 64 and max > 1.5 × min, the least loaded worker; otherwise the worker
  whose tree of sent prompts matches the longest prefix when the match covers more than 30 % of the prompt,
  else the worker with the smallest tree. The tree here holds block keys of 16 tokens of what the router
  sent (the peers hold characters: the same prefixes at a finer grain), never evicted within a run (their
  default eviction keeps up to 2^26 characters per worker).
- ``dynamo_kv``: Dynamo's KV router cost with its defaults (overlap weight 1, temperature 0): for each
  worker, blocks still to prefill (this request's uncached blocks, from the KV events, plus the prefill
  blocks of what it sent there that has no first token yet) plus the decode blocks active there (every
  block of what it sent there that has not ended, this request's included); the lowest cost, ties at random.
- ``oracle``: the worker whose engine really holds the longest cached prefix, ties to the fewest running +
  waiting (``bench.routers.OracleRouter`` asks the simulated workers the same).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.lab_fleet import LabFleet, LabWorker
from extproc.inflight import InflightTracker
from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.wire import EventBatch
from extproc.metrics import Metrics
from extproc.output_lengths import OutputLengths
from extproc.peers import summed
from extproc.pipeline.context import Placement
from extproc.pipeline.place import Place
from extproc.placed_prefixes import PlacedPrefixes
from extproc.prefill_ledger import Unsettled, placed_since
from extproc.scheduling import Decision, NoCapacity, PickRequest, RequestProfiler, build_scheduler
from extproc.siblings import SIBLING_EXCHANGE_S
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from simworker.engine import EngineRequest


@dataclass(frozen=True, slots=True)
class LabRequest:
    """One request of a trace, tokenised once: what the routers and the engine need of it."""

    index: int
    arrival_s: float
    model: str
    workload: str
    slo_ttft_s: float
    profile: PickRequest
    """poolgate's profile of the body (the character estimate; the blocks are added where it tokenises)."""
    blocks: PromptBlocks
    """The prompt's router block keys (16-token blocks), from the engine's own token ids."""
    engine: EngineRequest

    @property
    def prompt_tokens(self) -> int:
        return self.engine.prompt_tokens


HOLD = "hold"
"""A router's answer for a request it keeps for now (poolgate's queue); ``None`` refuses it."""
Route = str | None


class LabRouter(Protocol):
    name: str

    def route(self, request: LabRequest, now: float, held_s: float) -> Route: ...

    def on_first_token(self, request: LabRequest, worker_id: str, now: float) -> None: ...

    def on_finished(self, request: LabRequest, worker_id: str, output_tokens: int, now: float) -> None: ...

    def on_records(self, snapshot: FleetSnapshot, now: float) -> None: ...

    def on_kv_events(self, worker_id: str, batch: EventBatch) -> None: ...


class _Quiet:
    """Defaults for the hooks a reference policy does not use."""

    def on_first_token(self, request: LabRequest, worker_id: str, now: float) -> None:
        return None

    def on_finished(self, request: LabRequest, worker_id: str, output_tokens: int, now: float) -> None:
        return None

    def on_records(self, snapshot: FleetSnapshot, now: float) -> None:
        return None

    def on_kv_events(self, worker_id: str, batch: EventBatch) -> None:
        return None


class _Counted(_Quiet):
    """Requests in flight per worker, the router's own exact count (from routing to the response's end)."""

    def __init__(self, workers: Mapping[str, Sequence[str]], seed: int) -> None:
        self.workers = workers
        """Model → its worker ids."""
        self.inflight: dict[str, int] = {w: 0 for ids in workers.values() for w in ids}
        self.rng = random.Random(seed)

    def on_finished(self, request: LabRequest, worker_id: str, output_tokens: int, now: float) -> None:
        self.inflight[worker_id] -= 1

    def sent(self, worker_id: str) -> str:
        self.inflight[worker_id] += 1
        return worker_id

    def least_loaded(self, candidates: Sequence[str]) -> str:
        low = min(self.inflight[w] for w in candidates)
        return self.rng.choice([w for w in candidates if self.inflight[w] == low])


class LeastRequest(_Counted):
    name = "least_request"

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        return self.sent(self.least_loaded(self.workers[request.model]))


class PowerOfTwo(_Counted):
    name = "power_of_two"

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        candidates = self.workers[request.model]
        pair = self.rng.sample(list(candidates), 2) if len(candidates) > 1 else list(candidates)
        return self.sent(self.least_loaded(pair))


CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class CacheAware(_Counted):
    name = "cache_aware"

    def __init__(self, workers: Mapping[str, Sequence[str]], seed: int) -> None:
        super().__init__(workers, seed)
        self.trees: dict[str, set[int]] = {w: set() for w in self.inflight}

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        candidates = self.workers[request.model]
        loads = [self.inflight[w] for w in candidates]
        high, low = max(loads), min(loads)
        keys = request.blocks.keys[16]
        if high - low > BALANCE_ABS_THRESHOLD and high > low * BALANCE_REL_THRESHOLD:
            chosen = self.least_loaded(candidates)
        else:
            best, best_match = candidates[0], -1
            for worker_id in candidates:
                tree = self.trees[worker_id]
                match = 0
                for key in keys:
                    if key not in tree:
                        break
                    match += 1
                if match > best_match:
                    best, best_match = worker_id, match
            rate = best_match * 16 / max(1, request.prompt_tokens)
            if rate > CACHE_THRESHOLD:
                chosen = best
            else:
                smallest = min(len(self.trees[w]) for w in candidates)
                chosen = self.rng.choice([w for w in candidates if len(self.trees[w]) == smallest])
        self.trees[chosen].update(keys)
        return self.sent(chosen)


class DynamoKv(_Counted):
    name = "dynamo_kv"

    def __init__(self, workers: Mapping[str, Sequence[str]], seed: int, clock: Callable[[], float]) -> None:
        super().__init__(workers, seed)
        self.index = PrefixIndex(pending_s=0.0)
        self.prefill_blocks: dict[str, int] = dict.fromkeys(self.inflight, 0)
        self.active_blocks: dict[str, int] = dict.fromkeys(self.inflight, 0)
        self._prefill_of: dict[int, int] = {}
        self._clock = clock

    def on_kv_events(self, worker_id: str, batch: EventBatch) -> None:
        self.index.mark_known(worker_id)
        self.index.apply(worker_id, batch)

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        candidates = self.workers[request.model]
        keys = request.blocks.keys[16]
        blocks = -(-request.prompt_tokens // 16)
        overlap = self.index.cached_blocks(keys, candidates, now)
        costs = [(blocks - overlap.get(w, 0)) + self.prefill_blocks[w] + self.active_blocks[w] + blocks
                 for w in candidates]
        low = min(costs)
        chosen = self.rng.choice([w for w, cost in zip(candidates, costs, strict=True) if cost == low])
        new_prefill = blocks - overlap.get(chosen, 0)
        self._prefill_of[request.index] = new_prefill
        self.prefill_blocks[chosen] += new_prefill
        self.active_blocks[chosen] += blocks
        return self.sent(chosen)

    def on_first_token(self, request: LabRequest, worker_id: str, now: float) -> None:
        self.prefill_blocks[worker_id] -= self._prefill_of.pop(request.index, 0)

    def on_finished(self, request: LabRequest, worker_id: str, output_tokens: int, now: float) -> None:
        super().on_finished(request, worker_id, output_tokens, now)
        self.prefill_blocks[worker_id] -= self._prefill_of.pop(request.index, 0)
        self.active_blocks[worker_id] -= -(-request.prompt_tokens // 16)


class Oracle(_Quiet):
    name = "oracle"

    def __init__(self, fleet: LabFleet, seed: int) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        workers = self.fleet.by_model[request.model]
        hashes = request.engine.prompt_block_hashes
        usable = hashes[:(request.prompt_tokens - 1) // 16]

        def merit(worker: LabWorker) -> tuple[int, int]:
            engine = worker.engine
            return engine.kv.cached_prefix_blocks(usable), -(engine.num_running + engine.num_waiting)

        best = max(merit(w) for w in workers)
        return self.rng.choice([w for w in workers if merit(w) == best]).id


@dataclass
class _Replica:
    place: Place
    inflight: InflightTracker
    lookup: CacheLookup
    placed_prefixes: PlacedPrefixes
    placements: dict[int, Placement] = field(default_factory=dict)
    peer_prefill: dict[tuple[str, str], Unsettled] = field(default_factory=dict)
    """(Worker id, replica) → the others' prefill reservations at the last exchange (as ``peers`` keeps them)."""


class Poolgate(_Quiet):
    """The product's scheduling path, ``processes`` replicas of it."""

    name = "poolgate"

    def __init__(self, settings: SchedulingSettings, pools: Sequence[PoolSpec], clock: Callable[[], float],
                 seed: int, processes: int = 1, exchange_s: float = 0.05, siblings: bool = False) -> None:
        self.settings = settings
        self.siblings = siblings
        self.pools = tuple(pools)
        self.clock = clock
        self.processes = processes
        self.exchange_s = SIBLING_EXCHANGE_S if siblings else exchange_s
        self._snapshot = build_snapshot([], self.pools, taken_at=clock(), stale_after_s=3.0)
        self.profiler = RequestProfiler(settings)
        learned = settings.learned_output
        self.lengths = OutputLengths(learned.quantile, learned.window, learned.min_samples,
                                     learned.tenant_min_samples) if learned.enabled else None
        self.replicas = [self._replica(seed + i) for i in range(processes)]
        self._replica_of: dict[int, _Replica] = {}
        self._dealt = 0
        self._inflight_totals: dict[str, int] = {}
        self._next_exchange = 0.0
        self._subscribed: set[str] = set()

    def _replica(self, seed: int) -> _Replica:
        index = PrefixIndex()
        lookup = CacheLookup(index, lambda: self._snapshot, clock=self.clock)
        inflight = InflightTracker()
        scheduler = build_scheduler(self.settings, random.Random(seed))
        placed_prefixes = PlacedPrefixes()
        place = Place(scheduler, self, inflight, Metrics(), self.settings, clock=self.clock, timer=self.clock,
                      prefix_cache=lookup, placed_prefixes=placed_prefixes)
        place.reservations.exchange_s = self.exchange_s
        return _Replica(place, inflight, lookup, placed_prefixes)

    @property
    def snapshot(self) -> FleetSnapshot:
        return self._snapshot

    def route(self, request: LabRequest, now: float, held_s: float) -> Route:
        self._maybe_exchange(now)
        replica = self._replica_of.get(request.index)
        if replica is None:
            replica = self._replica_of[request.index] = self.replicas[self._dealt % self.processes]
            self._dealt += 1
        profile = request.profile
        if self.lengths is not None:
            profile = self.lengths.refine(profile, "")
        # The prompt as the engine tokenises it, for the sizes of the blocks the index holds.
        pick_request = PickRequest(
            facts=profile.facts, prompt_tokens=request.prompt_tokens, min_prompt_tokens=profile.min_prompt_tokens,
            output_tokens=profile.output_tokens, task_class=profile.task_class,
            affinity_keys=profile.affinity_keys, prompt_blocks=request.blocks, held_s=held_s)
        outcome = replica.place.pick(pick_request, None)
        if isinstance(outcome, Decision):
            replica.placements[request.index] = replica.place.commit(pick_request, outcome)
            if self.siblings:
                self._tell_siblings(replica, pick_request, outcome.worker_id)
            return outcome.worker_id
        if isinstance(outcome, NoCapacity) and held_s < self.settings.max_wait_s:
            return HOLD
        return None

    def on_finished(self, request: LabRequest, worker_id: str, output_tokens: int, now: float) -> None:
        replica = self._replica_of.pop(request.index)
        placement = replica.placements.pop(request.index, None)
        if placement is not None:
            replica.place.release(placement)
        if self.lengths is not None:
            self.lengths.observe(request.model, request.profile.task_class, "", output_tokens)

    def on_records(self, snapshot: FleetSnapshot, now: float) -> None:
        self._snapshot = snapshot
        for worker in snapshot.by_id.records():
            # A publisher that has stored nothing yet is in sync with an empty cache: extproc's subscriber
            # finds so at its first replay check (``kvcache.stream``), before the engine's first event.
            if worker.kv_events_endpoint and worker.id not in self._subscribed:
                self._subscribed.add(worker.id)
                for replica in self.replicas:
                    replica.lookup.index.mark_known(worker.id)
        self._maybe_exchange(now)

    def on_kv_events(self, worker_id: str, batch: EventBatch) -> None:
        for replica in self.replicas:
            replica.lookup.index.mark_known(worker_id)
            replica.lookup.index.apply(worker_id, batch)

    def _tell_siblings(self, placer: _Replica, request: PickRequest, worker_id: str) -> None:
        """A placement's prompt blocks pending on its worker in every other replica's index at once."""
        worker = self._snapshot.by_id.get(worker_id)
        if worker is None:
            return
        for replica in self.replicas:
            if replica is not placer:
                replica.lookup.placed(worker, request)

    def _maybe_exchange(self, now: float) -> None:
        """What the replicas tell each other through Redis, every ``exchange_s`` (siblings: before every
        pick): reservations, in-flight deltas, affinity records, and the prompt blocks their placements made
        pending (which siblings were told at once)."""
        if self.processes == 1 or (now < self._next_exchange and not self.siblings):
            return
        self._next_exchange = now + self.exchange_s
        totals = self._inflight_totals
        for replica in self.replicas:
            deltas = replica.inflight.take_pending()
            replica.inflight.mark_flushed(deltas)
            for worker_id, delta in deltas.items():
                totals[worker_id] = totals.get(worker_id, 0) + delta
        records = [r.place.affinity.take_unpublished() for r in self.replicas]
        blocks = [r.placed_prefixes.take() for r in self.replicas]
        held = [r.place.reservations.own_reservations() for r in self.replicas]
        for own, replica in enumerate(self.replicas):
            kv, prefill, by_replica = summed((worker_id, str(other), kv_tokens, prefill_tokens, requests)
                                             for other, reservations in enumerate(held) if other != own
                                             for worker_id, (kv_tokens, prefill_tokens, requests)
                                             in reservations.items())
            for other in range(len(self.replicas)):
                if other == own:
                    continue
                replica.place.affinity.apply(records[other])
                if not self.siblings:
                    for worker_id, keys in blocks[other]:
                        replica.lookup.placed_elsewhere(worker_id, keys)
            placed = placed_since(replica.peer_prefill, by_replica)
            replica.peer_prefill = by_replica
            replica.place.reservations.apply_peers(kv, prefill, self.processes, rank=own, at=now, placed=placed)
            replica.inflight.apply_remote(dict(totals))


def records_snapshot(records: Sequence[WorkerRecord], pools: Sequence[PoolSpec], now: float) -> FleetSnapshot:
    return build_snapshot(list(records), tuple(pools), taken_at=now, stale_after_s=3.0)
