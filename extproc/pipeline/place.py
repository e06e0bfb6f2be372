"""The place stage: the scheduler's pick over the live snapshot, and what a placement holds until its end.

The pick itself is pure (``scheduling``); around it this stage keeps the replica's own accounting that the
snapshot cannot show yet: in-flight counts, KV and prefill reservations (settled when a newer snapshot
arrives) and the affinity map. A placement acquires all three at once and ``release`` gives them back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from extproc.affinity import AffinityMap
from extproc.disagg import DisaggPlan, PairDecision, pick_pair
from extproc.endpoint_picker import within
from extproc.errors import no_worker
from extproc.inflight import InflightTracker
from extproc.kvcache.lookup import CacheLookup, PlacedPrompt
from extproc.metrics import Metrics
from extproc.pipeline.context import Placement
from extproc.pipeline.outcomes import Refused
from extproc.placed_prefixes import PlacedPrefixes
from extproc.prefill_ledger import PrefillLedger
from extproc.reservations import Reservation, ReservationBook
from extproc.scheduling import Decision, NoCapacity, PickContext, PickRequest, Scheduler
from extproc.scheduling.estimate import exact_prompt
from extproc.siblings import Siblings
from extproc.snapshot import FleetSnapshot
from extproc.tenancy import Tenant
from poolgate.kernel.config import SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord

DECISION_HEADER = "x-poolgate-decision"
TENANT_HEADER = "x-poolgate-tenant"
"""Set on the upstream request: the tenant extproc identified (client copies are stripped by Envoy)."""


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> FleetSnapshot: ...


class Place:
    def __init__(self, scheduler: Scheduler, fleet: SnapshotSource, inflight: InflightTracker, metrics: Metrics,
                 settings: SchedulingSettings, clock: Callable[[], float] = time.time,
                 timer: Callable[[], float] = time.perf_counter, prefix_cache: CacheLookup | None = None,
                 disagg: DisaggPlan | None = None, *, reservations: ReservationBook | None = None,
                 affinity: AffinityMap | None = None, siblings: Siblings | None = None,
                 placed_prefixes: PlacedPrefixes | None = None) -> None:
        """``reservations``, ``affinity`` and ``placed_prefixes`` are the replica's (``extproc.replica.ReplicaState``),
        shared with the peer exchange; left out, this stage gets its own reservations and map from ``settings``
        and keeps no prompt blocks for other hosts. ``siblings``: the other processes of this host, told of
        every placement and release at once and heard before every pick."""
        self.scheduler = scheduler
        self.fleet = fleet
        self.inflight = inflight
        # ``is None``, not ``or``: an empty affinity map is falsy (it has a length), and a stage that built its own
        # would fill a map the peer exchange never shares.
        self.reservations = (reservations if reservations is not None
                             else ReservationBook(settings.reservation_settle_s, settings.kv_reserve_fraction))
        self.affinity = affinity if affinity is not None else AffinityMap(settings.affinity_max_entries)
        self._metrics = metrics
        self._debug_header = settings.debug_header
        self._clock = clock
        """Wall clock, the one worker records are stamped with (reservations compare against it)."""
        self._timer = timer
        self._settled_for: FleetSnapshot | None = None
        self.prefix_cache = prefix_cache
        """The workers' KV events, where they publish them (None: no cache lookups at all)."""
        self.disagg = disagg
        """Models whose long prompts are split over a prefill and a decode worker (None: no model)."""
        self._default_prefill_rate = settings.default_prefill_tokens_per_s
        self.ledger = PrefillLedger(settings.default_prefill_tokens_per_s)
        """The prefill placed on each worker, by this replica and the others, that its engine has not done yet."""
        self._task_classes = settings.task_classes
        self.siblings = siblings
        self.placed_prefixes = placed_prefixes

    @property
    def snapshot(self) -> FleetSnapshot:
        return self.fleet.snapshot

    def context(self) -> PickContext:
        """The current snapshot with this replica's accounting; settles reservations on a new snapshot, or
        when the other replicas' reservations changed, and enters the prefill the other replicas placed
        (as the exchange brought it) into the ledger. What the sibling processes sent is taken first."""
        if self.siblings is not None:
            self.siblings.receive()
        snapshot = self.fleet.snapshot
        reservations = self.reservations
        if snapshot is not self._settled_for or reservations.peers_moved:
            if snapshot is not self._settled_for:
                self._observe_rates(snapshot)
            reservations.settle(snapshot)
            self._settled_for = snapshot
        now = self._clock()
        placed = reservations.take_peer_placements()
        if placed:
            by_id = snapshot.by_id
            for worker_id, (tokens, requests), read_at in placed:
                worker = by_id.get(worker_id)
                if worker is not None:
                    self.ledger.placed(worker, tokens, now, since=read_at, requests=requests)
        return PickContext(snapshot, self.inflight.counts, reservations.kv_tokens, self.ledger.at(now),
                           self.affinity.entries,
                           self.prefix_cache.for_pick() if self.prefix_cache is not None else None,
                           self.ledger)

    def _observe_rates(self, snapshot: FleetSnapshot) -> None:
        """Fold the records that changed since the last snapshot into the kinds' peak prefill rates."""
        before = self._settled_for
        if before is None:
            self.ledger.rates.observe(snapshot.by_id.records())
            return
        by_id = snapshot.by_id
        self.ledger.rates.observe(record for worker_id in by_id.changed_since(before.by_id)
                                  if (record := by_id.get(worker_id)) is not None)

    def wants_prompt(self, request: PickRequest) -> bool:
        """Tokenise this request's prompt first: some worker that may take it reports its cache."""
        return self.prefix_cache is not None and self.prefix_cache.wants(request)

    async def prepare(self, request: PickRequest, body: bytes) -> PickRequest:
        """The request with its prompt's block keys (tokenised off the loop when long) and then its exact prompt
        count in place of the estimate: what the decision header shows, the context limit and quotas use."""
        if self.prefix_cache is None:
            return request
        prepared = await self.prefix_cache.prepare(request, body)
        blocks = prepared.prompt_blocks
        return prepared if blocks is None else exact_prompt(prepared, blocks.token_count, self._task_classes)

    def pick(self, request: PickRequest, subset: frozenset[str] | None) -> (
            Decision | PairDecision | NoCapacity | Refused):
        """The scheduler's answer, among the gateway's ``subset`` of endpoints when it sent one."""
        started = self._timer()
        context = self.context()
        if subset is not None:
            fleet = context.snapshot
            context = replace(context, snapshot=within(fleet, subset))
            if not context.snapshot.workers_for(request.model) and request.model in fleet.models:
                return Refused(no_worker(request.model))  # the gateway left no endpoint
        outcome = (self.scheduler.pick(request, context) if self.disagg is None
                   else pick_pair(self.scheduler, request, context, self.disagg))
        self._metrics.pick_seconds.observe(self._timer() - started)
        if isinstance(outcome, Decision | PairDecision | NoCapacity):
            return outcome
        if outcome.code != "model_not_found":  # a client's unknown model names must not become label values
            self._metrics.pick_refusals.labels(request.model, outcome.code or outcome.type).inc()
        return Refused(outcome)

    def predicted_prefill_s(self, request: PickRequest) -> float:
        """Seconds of prefill the request needs at best: the prompt part no ready worker of its model caches,
        at the fastest of their prefill rates (what orders held requests inside a tenant)."""
        workers = self.fleet.snapshot.ready_workers_for(request.model)
        rate = max((w.prefill_tokens_per_s for w in workers), default=0.0) or self._default_prefill_rate
        return self._uncached_tokens(request, workers) / rate

    def _uncached_tokens(self, request: PickRequest, workers: tuple[WorkerRecord, ...]) -> int:
        blocks = request.prompt_blocks
        if blocks is None or self.prefix_cache is None or not workers:
            return request.prompt_tokens
        cached = self.prefix_cache.cached_tokens(blocks, workers)
        return max(0, blocks.token_count - max(cached.values(), default=0))

    def count_no_capacity(self, request: PickRequest, outcome: NoCapacity) -> None:
        self._metrics.pick_refusals.labels(request.model, outcome.reason).inc()

    def commit(self, request: PickRequest, decision: Decision | PairDecision) -> Placement:
        """Count and reserve on the worker (on both of a pair: the prompt on the prefill worker, the prompt's
        KV and the output on the decode worker, which holds the KV after the transfer)."""
        prefill: Reservation | None = None
        by_id = self.fleet.snapshot.by_id
        if isinstance(decision, PairDecision):
            self._acquire(request, decision.prefill, by_id.get(decision.prefill.worker_id), prefill_only=True)
            prefill = self.reservations.reserve(decision.prefill.worker_id, request.prompt_tokens, 1, self._clock())
            decision = decision.routed
        worker_id = decision.worker_id
        worker = by_id.get(worker_id)
        placed = self._acquire(request, decision, worker, prefill_only=False)
        now = self._clock()
        if worker is None:
            reservation = self.reservations.reserve(worker_id, request.prompt_tokens, request.output_tokens, now)
        else:
            # What the index held there before this prompt's blocks were marked pending (it would find itself
            # cached). New KV there: the prompt less what the worker's cache holds now (blocks pending from a
            # request just placed are not shared by one admitted beside it). Prefill still to do: less the
            # pending blocks too, which the engine computes first and this request then finds.
            new_kv = to_compute = request.prompt_tokens
            if placed is not None:
                new_kv = placed.prompt_tokens - placed.held_tokens
                to_compute = placed.prompt_tokens - placed.held_or_pending_tokens
            reservation = self.reservations.reserve(worker_id, new_kv, request.output_tokens, now,
                                                    prefill_tokens=to_compute)
            self.ledger.placed(worker, to_compute, now)
        if request.affinity_keys:
            self.affinity.record(request.affinity_keys, worker_id)
        if self.siblings is not None:
            self.siblings.send(_workers_of(reservation, prefill))
        return Placement(decision, reservation, prefill)

    def _acquire(self, request: PickRequest, decision: Decision, worker: WorkerRecord | None,
                 prefill_only: bool) -> PlacedPrompt | None:
        """Count the request on the worker and mark its prompt's blocks pending there (for the siblings too,
        with the affinity records of the worker that serves it, and the blocks new there for the replicas on
        other hosts); returns what the KV index held for the prompt there before (None: no lookup, or the
        worker's record is gone from the snapshot)."""
        worker_id = decision.worker_id
        self.inflight.acquire(worker_id)
        placed = None
        keys: Sequence[int] = ()
        if self.prefix_cache is not None and worker is not None:
            placed = self.prefix_cache.placed(worker, request)
            if placed is not None:
                keys = placed.keys
                if self.placed_prefixes is not None and len(keys) > placed.counted:
                    self.placed_prefixes.placed(worker_id, keys[placed.counted:])
        if self.siblings is not None:
            affinity = () if prefill_only else tuple((key, worker_id) for key in request.affinity_keys)
            if keys or affinity:
                self.siblings.placed(worker_id, keys, affinity)
        self._metrics.picks.labels(decision.pool, worker_id).inc()
        return placed

    def headers(self, decision: Decision | PairDecision, request: PickRequest,
                tenant: Tenant | None) -> tuple[tuple[str, str], ...]:
        """Upstream headers of a placed request: the debug header when on, the tenant when one is named, the
        pair of a split request (for the sidecar)."""
        extra: list[tuple[str, str]] = []
        if isinstance(decision, PairDecision):
            extra.extend(decision.headers())
            decision = decision.routed
        if self._debug_header:
            extra.append((DECISION_HEADER, describe(decision, request)))
        if tenant is not None:
            extra.append((TENANT_HEADER, tenant.name))
        return tuple(extra)

    def release(self, placement: Placement) -> None:
        self.inflight.release(placement.decision.worker_id)
        self.reservations.release(placement.reservation)
        if placement.prefill is not None:
            self.inflight.release(placement.prefill.worker_id)
            self.reservations.release(placement.prefill)
        if self.siblings is not None:
            self.siblings.send(_workers_of(placement.reservation, placement.prefill))


def _workers_of(reservation: Reservation, prefill: Reservation | None) -> tuple[str, ...]:
    return (reservation.worker_id,) if prefill is None else (reservation.worker_id, prefill.worker_id)


def describe(decision: Decision, request: PickRequest) -> str:
    """The debug header's value: where the request went, what it was estimated to need, and why."""
    scores = " ".join(f"{name}={score:.3f}" for name, score in decision.scores)
    return (f"worker={decision.worker_id} pool={decision.pool} class={request.task_class} "
            f"prompt_tokens={request.prompt_tokens} output_tokens={request.output_tokens} {scores}").rstrip()
