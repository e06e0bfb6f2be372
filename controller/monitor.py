"""The health monitor: probes every registered worker each interval and writes the verdicts to Redis.

Keeps its own copy of the fleet (``FleetView``: only changed records are re-read), reads the data path's failure
counters, probes the workers spread over the first half of the interval with at most ``PROBE_CONCURRENCY`` in
flight (a large fleet is not probed in one burst; a hung worker's probe gives its slot back once it is slow, while
the controller keeps time; a serving worker's failed probe is repeated at once to confirm it, so a dead worker
leaves within the round that finds it), judges each as its probes end (``controller.health``), writes the states
that differ from what Redis holds in batches, every ``WRITE_EVERY_S`` while the round runs, each with one
announcement (so a mass failure costs readers a read per batch, not one per worker, and a worker found dead early
in a long round leaves then), and hands remedies to the instance controller. Between and during rounds it looks at
the data path's failure counts every ``PASSIVE_WATCH_S`` (every Envoy reports its failed upstream attempts,
``controller.xds.upstream_failures``) and fails at once a serving worker that crossed ``passive_failures_to_fail`` (no
probe to wait for: those failures decide): a worker that fails requests leaves within a fraction of a second even
when a round over a large fleet takes seconds. At the same pace it probes, out of turn, a serving worker that
closed its kept-alive probe connection (a process that exited closes it at once; so does a keep-alive timeout,
which the probe then passes). Only the leader acts; a follower keeps quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from controller.health import HEALTHY, HealthMemory, ProbeResult, Remedy, Verdict, initial_memory, judge, settled
from controller.periodic import every
from controller.probe import Answered, ProbesInTasks
from controller.recent_failures import RecentFailures
from poolgate.kernel.coarse_timers import CoarseTimer, CoarseTimers, coarse_timers
from poolgate.kernel.config import HealthSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import OutageLog
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.health")

PROBE_CONCURRENCY = 256
"""A round's probes in flight at once; more wait for a slot, and the wait is not counted in a probe's timeout.
So on a busy controller they queue here instead of timing out: at 2,048, 2,387 of 10,000 healthy workers
failed their probes ("no answer within 1 s") while the fleet registered. A slow probe gives its slot back
after ``SLOT_HOLD_S`` while the loop keeps time. Probes out of turn have slots of their own and never queue
behind a round."""
SLOT_HOLD_S = 0.1
"""A probe still unanswered this long gives its slot back (it goes on waiting until its timeout) when the wait
is the worker's: the controller's loop keeps time, or a probe started after this one has come back already. A
hung worker must not hold a round's slot for its whole timeout (1,000 hung workers held 256 slots for 3 s each,
and took 15 s to leave). On a late loop with no later probe back it keeps its slot, and looks again after as
long: the wait may be the controller's own, and more probes would only lengthen it. (Looking at the loop alone,
a loaded controller whose loop ran late kept the slots of 1,000 hung workers for whole timeouts: their
verdicts came in waves 3 s apart.)"""
LOOP_LATE_S = 0.05
"""The loop keeps time when the slot's give-back timer fires at most this late."""
MAX_LOOKS = 3
"""A slow probe looks whether to give its slot back at most this many times (every ``SLOT_HOLD_S``); at the last
it gives the slot back whatever the loop did. Workers that hang at the head of a round have no later probe to vouch
for them: on a loop late at every look they held their slots for whole timeouts, and would leave in waves a
timeout apart; now a wave lasts three looks. ``LINGER_LIMIT`` still bounds the probes out without a slot."""
LINGER_LIMIT = 2048
"""Probes waiting without a slot at most (each costs a socket and a timer, no CPU)."""
EARLY_LIMIT = 2048
"""Confirming probes started early (``CONFIRM_SHARE``) in flight at most: 1,000 workers that hang at once get
theirs, and a controller so late that every probe looks slow sends a bounded number more."""
PROBE_SPREAD = 0.5
"""Share of the probe interval over which a round's probes start (the rest is room for slow answers)."""
CONFIRM_SHARE = 0.5
"""A serving worker's probe that failed, or that is still unanswered, this share of the probe interval after it
started is followed by another, until one passes or the failures reach ``failures_to_fail``. So confirmations
of a hang overlap: probes start 0.25 s apart and a hung worker is Failed once the last of them times out
(1.5 s after the first started, at the defaults), not after three timeouts one after the other (3 s: with a
round of 1.3 s before it, 1,000 workers hung at once took up to 6.7 s to leave on a loaded host). The evidence
stays ``failures_to_fail`` probes that all failed, the last started ``CONFIRM_SHARE × (failures_to_fail - 1)``
intervals after the first: a worker that answers any of them stays serving, and one slow answer never ejects
it. Only a probe still out after ``SLOT_HOLD_S`` plans early confirmations (a probe answered in time costs
nothing more), and at most ``EARLY_LIMIT`` are in flight. A confirmation takes no slot: there are
``failures_to_fail`` per failing worker at most, and when 1,000 of 10,000 hung at once, their repeats waiting
for the round's slots delayed both their verdicts and the round."""
WRITE_EVERY_S = 0.25
"""While a round runs, the state changes it found are written this often (each write one batch, one
announcement)."""
PASSIVE_WATCH_S = 0.25
"""How often the data path's failure counts are read (one hash read, as large as the workers that failed) and
the probe connections looked at."""
PACE_AHEAD_S = 0.005
"""The round's pacer sleeps only once it is this far ahead of its schedule: probes start in small bursts, with
no timer of their own for the wait."""


class Prober(Protocol):
    async def probe(self, record: WorkerRecord) -> ProbeResult: ...

    def hung_up(self) -> list[str]:
        """Workers that closed their probe connection since the last call."""
        ...


@runtime_checkable
class AskingProber(Prober, Protocol):
    """A prober that also starts a probe with no coroutine, its result handed to ``answered`` (``HttpProber``): a
    check's first probe then costs no task (with a task and a chain of coroutines per probe, a third of the
    monitor's CPU at 10,000 workers went to them). A prober without ``ask`` is asked through a task."""

    def ask(self, record: WorkerRecord, answered: Answered) -> None: ...


class Remediator(Protocol):
    """Acts on a remedy; the instance controller decides whether it owns the worker."""

    async def remedy(self, worker_id: str, remedy: Remedy, reason: str) -> None: ...


class RemedyElsewhere:
    """A remediator on another event loop (the controller's, when the monitor runs on its own): each remedy
    runs there through ``call`` (``controller.own_loop.CallOnLoop``) and is waited for here."""

    def __init__(self, remediator: Remediator,
                 call: Callable[[Coroutine[Any, Any, None]], Awaitable[None]]) -> None:
        self._remediator = remediator
        self._call = call

    async def remedy(self, worker_id: str, remedy: Remedy, reason: str) -> None:
        await self._call(self._remediator.remedy(worker_id, remedy, reason))


@dataclass
class MonitorStats:
    rounds: int = 0
    probes: int = 0
    probe_failures: int = 0
    transitions: dict[str, int] = field(default_factory=dict)
    """``"Ready->Failed"`` → count."""
    batches: int = 0
    """State writes (each carries every change of one round)."""
    out_of_turn: int = 0
    """Workers judged at once, out of turn, because the data path reported them failing."""
    hung_up: int = 0
    """Workers probed at once, out of turn, because they closed their probe connection."""
    slots_given_back: int = 0
    """Probes that gave their slot back to wait on without one (``SLOT_HOLD_S``)."""
    early_confirmations: int = 0
    """Confirming probes started while the probe they confirm was still out (``CONFIRM_SHARE``)."""
    remedies: dict[str, int] = field(default_factory=dict)
    last_round_s: float = 0.0
    """How long the last round took: a hung worker is found within about this long."""
    expiry_held: int = 0
    """Overdue workers the mass-expiry guard kept registered at the last round's start (``ChangePoll.held``)."""


@dataclass
class _Seen:
    registration: tuple[str, float]
    memory: HealthMemory
    settled: tuple[WorkerRecord, Verdict] | None = None
    """The record and verdict of its last judgement, where that verdict holds for every passed probe of the same
    record while no data-path failure is recent (``controller.health.settled``): a steady fleet's probes cost
    no judging (a fifth of the monitor's CPU per probe went to it)."""


class HealthMonitor:
    """Judges every worker each round. ``stale_after_s`` is extproc's bound on the age of agent facts
    (``extproc.stale_after_s``): older facts do not count as fresh evidence."""

    def __init__(self, store: FleetStore, settings: HealthSettings, stale_after_s: float, prober: Prober,
                 remediator: Remediator | None = None, *, is_leader: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 spread_s: float | None = None, write_every_s: float = WRITE_EVERY_S,
                 probe_concurrency: int = PROBE_CONCURRENCY, stats: MonitorStats | None = None) -> None:
        self._settings = settings
        self._stale_after_s = stale_after_s
        self._store = store
        self._prober = prober
        self._remediator = remediator
        self._is_leader = is_leader
        self._clock = clock
        self._wall_clock = wall_clock
        self._seen: dict[str, _Seen] = {}
        self._view = FleetView(store, live=True)
        self._spread_s = settings.probe_interval_s * PROBE_SPREAD if spread_s is None else spread_s
        self._spacing = settings.probe_interval_s * CONFIRM_SHARE
        self._early_budget = _Budget(EARLY_LIMIT)
        self._early: dict[str, _EarlyConfirmations] = {}
        """Early confirmations planned for the slow probes still out (``_plan_early``), by worker."""
        self._ask = prober.ask if isinstance(prober, AskingProber) else ProbesInTasks(prober.probe).ask
        self._slots = _Slots(probe_concurrency)
        self._out_of_turn_slots = _Slots(probe_concurrency)
        self._write_every_s = write_every_s
        self._pending: dict[str, tuple[WorkerRecord, Verdict]] = {}
        """State changes judged and not written yet."""
        self._recent = RecentFailures(settings.passive_window_s)
        """The data path's failures per worker within ``passive_window_s``."""
        self._checking: set[str] = set()
        """Workers whose check is under way: the watcher and the next round leave them to its verdict."""
        self._tasks: set[asyncio.Task[None]] = set()
        """The tasks of checks under way: confirming a failure, waiting for a slot out of turn, or a remedy."""
        self._lingering = 0
        """Probes waiting without a slot."""
        self._answered = float("-inf")
        """When the latest probe answered in time had started (the loop's clock): a slow probe started before it
        waits for its worker, not for this loop."""
        self._written: dict[str, WorkerState] = {}
        """States this monitor wrote since its view last synced (the view's records do not show them yet)."""
        self._timers: tuple[asyncio.AbstractEventLoop, CoarseTimers] | None = None
        """The monitor's loop and its coarse timers, once looked up (a lookup per probe cost 3 % of its CPU)."""
        self.stats = stats if stats is not None else MonitorStats()
        """Counts for ``/metrics``; given when they are read from another thread than the monitor's."""

    def memory(self, worker_id: str) -> HealthMemory | None:
        seen = self._seen.get(worker_id)
        return seen.memory if seen else None

    async def round(self) -> None:
        """One probe of every worker and the writes and remedies that follow. The round ends once every
        first probe is answered or timed out; a failing worker's confirming probes go on after it (its
        verdict is written with the next watch's batch), and the next round leaves that worker to them."""
        if not self._is_leader():
            self._seen.clear()  # a new leader starts from what Redis says
            self._view.mark_stale()
            return
        started = self._clock()
        await self._view.sync()
        self.stats.expiry_held = self._view.held
        self._written.clear()
        records = self._view.workers()
        self._recent.read(await self._store.read_passive_failures(prune_to=self._view.records), self._clock())
        step = max(self._spread_s / len(records), 1 / self._settings.max_probes_per_s) if records else 0.0
        done = asyncio.Event()
        writer = asyncio.create_task(self._write_until(done))
        try:
            first_probes = _FirstProbes()
            await self._start_checks(records, step, first_probes)
            await first_probes.all_in()  # each ends by the probe timeout; confirmations go on
        finally:
            done.set()
            await writer  # its last write takes what the round found since the one before
        self.stats.rounds += 1
        self.stats.last_round_s = self._clock() - started
        listed = {r.id for r in records}
        for gone in [worker_id for worker_id in self._seen if worker_id not in listed]:
            del self._seen[gone]

    async def settle(self) -> None:
        """Wait for the checks still under way (the confirming probes a round left running), and write their
        verdicts."""
        while under_way := [task for task in self._tasks if not task.done()]:
            await asyncio.gather(*under_way, return_exceptions=True)  # (an error is logged by ``_task_ended``)
        await self._write_states()

    def cancel_checks(self) -> None:
        """Stop the checks' tasks still running (the monitor stops)."""
        for task in self._tasks:
            task.cancel()

    async def watch(self) -> None:
        """Between and during rounds: probe at once the serving workers that closed their probe connection,
        and judge at once those the data path reports failing."""
        if not self._is_leader():
            return
        for worker_id in self._prober.hung_up():
            self._probe_now(worker_id)
        await self._watch_passive()
        await self._write_states()  # what this and the checks out of turn found since the last watch

    def _serving(self, worker_id: str) -> tuple[WorkerRecord, _Seen] | None:
        """A worker that may be judged out of turn: known, serving, and with no probe of its own under way."""
        record, seen = self._view.records.get(worker_id), self._seen.get(worker_id)
        if record is None or seen is None or seen.memory.state not in HEALTHY or worker_id in self._checking:
            return None
        return record, seen

    def _probe_now(self, worker_id: str) -> None:
        """A check out of turn, in a slot of its own; its verdict is written with the next watch's batch (1,000
        workers that exit together: one write)."""
        if (serving := self._serving(worker_id)) is None:
            return
        record, _ = serving
        self.stats.hung_up += 1
        if self._out_of_turn_slots.take():
            self._start_check(record, self._out_of_turn_slots, None)
        else:
            self._checking.add(record.id)
            self._run(self._check_once_free(record))

    async def _check_once_free(self, record: WorkerRecord) -> None:
        try:
            await self._out_of_turn_slots.acquire()
        except BaseException:
            self._checking.discard(record.id)
            raise
        self._start_check(record, self._out_of_turn_slots, None)

    async def _watch_passive(self) -> None:
        """Read the data path's failure counts and judge, out of turn, every serving worker whose failures within
        ``passive_window_s`` reached ``passive_failures_to_fail`` (``watch`` writes the verdicts)."""
        totals = await self._store.read_passive_failures()
        now = self._clock()
        self._recent.read(totals, now)
        threshold = self._settings.passive_failures_to_fail
        suspects = [serving[0] for worker_id in self._recent.workers()
                    if (serving := self._serving(worker_id)) is not None
                    and self._recent.recent(worker_id, now) >= threshold]
        if not suspects:
            return
        self.stats.out_of_turn += len(suspects)
        verdicts = [self._judge(record, [None]) for record in suspects]  # the failures decide: no probe to wait for
        for record, verdict in zip(suspects, verdicts, strict=True):
            await self._remedy(record, verdict)

    async def _start_checks(self, records: Sequence[WorkerRecord], step: float, first_probes: _FirstProbes) -> None:
        """Each worker's check, started ``step`` after the one before and once one of the round's slots is free
        (taken here, for the check's first probe): one waiter for the slots, and no timer per probe. A worker
        whose check is still under way (confirming a failure, or out of turn) is left to it. ``first_probes``
        follows each check's first probe."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i, record in enumerate(records):
            if record.id in self._checking:
                continue
            if (ahead := started + i * step - loop.time()) > PACE_AHEAD_S:
                await asyncio.sleep(ahead)
            if not self._slots.take():
                await self._slots.acquire()
            if record.id in self._checking:  # (begun out of turn while this waited)
                self._slots.release()
                continue
            first_probes.add(record.id)
            self._start_check(record, self._slots, first_probes)

    def _start_check(self, record: WorkerRecord, slots: _Slots, first_probes: _FirstProbes | None) -> None:
        """Check one worker, its first probe in one of ``slots`` (taken already) with no task of its own: the
        answer is judged as it comes (``_first_answered``); only a failure to confirm goes on in a task.
        ``first_probes`` is told once that probe is in."""
        self._checking.add(record.id)
        held = self._hold(record, slots)
        try:
            self._ask(record, functools.partial(self._first_answered, record, held, first_probes))
        except Exception:
            log.exception("probe of worker %s failed to start", record.id)
            self._first_answered(record, held, first_probes, None)

    def _first_answered(self, record: WorkerRecord, held: _Held, first_probes: _FirstProbes | None,
                        result: ProbeResult | None) -> None:
        """A check's first probe is in (None: it has no result, and the check no verdict). Judged here, at once,
        unless it is a serving worker's failure to confirm (``_confirm``, in a task)."""
        try:
            self._release(held, result)
            needed = 1 if result is None or result.ok else self._confirmations_needed(record)
            if needed > 1:
                assert result is not None
                self._run(self._confirm(record, result, needed))
                return
            self._end_check(record)
            if result is not None and (verdict := self._judge(record, [result])).remedy is not Remedy.NONE:
                self._run(self._remedy(record, verdict))
        except Exception:  # (in a loop's callback: an error must not leave the round waiting for this probe)
            log.exception("health check of worker %s failed", record.id)  # it is checked again next round
            self._end_check(record)
        finally:
            if first_probes is not None:
                first_probes.done(record.id)

    async def _confirm(self, record: WorkerRecord, first: ProbeResult, needed: int) -> None:
        """The probes that confirm a serving worker's failed first probe, then its verdict and remedy."""
        try:
            verdict = self._judge(record, await self._confirmations(record, first, needed))
        finally:
            self._end_check(record)
        await self._remedy(record, verdict)

    def _end_check(self, record: WorkerRecord) -> None:
        self._checking.discard(record.id)
        if (planned := self._early.pop(record.id, None)) is not None:
            planned.cancel()  # the probes still out once one passed, and any not yet started

    def _run(self, check: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(check)
        self._tasks.add(task)
        task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("health check failed: %r", error)  # its worker is checked again next round

    def _judge(self, record: WorkerRecord, probes: Sequence[ProbeResult | None]) -> Verdict:
        """The verdict after ``probes`` (None: judged on the data path's failures alone)."""
        registration = (record.address, record.registered_at)
        seen = self._seen.get(record.id)
        if seen is None or seen.registration != registration:
            seen = _Seen(registration, initial_memory(record))
            self._seen[record.id] = seen
            self._recent.acted_on(record.id)  # failures from before it was first judged are not its own
        now = self._clock()
        recent = self._recent.recent(record.id, now)
        if (seen.settled is not None and seen.settled[0] is record and recent == 0
                and len(probes) == 1 and probes[0] is not None and probes[0].ok):
            self.stats.probes += 1
            verdict = seen.settled[1]
        else:
            verdict = self._judge_anew(record, probes, seen, recent, now)
        if verdict.state != self._written.get(record.id, record.state):
            self._pending[record.id] = (record, verdict)
        return verdict

    def _judge_anew(self, record: WorkerRecord, probes: Sequence[ProbeResult | None], seen: _Seen, recent: int,
                    now: float) -> Verdict:
        """``recent``: the worker's data-path failures within the window; once they decide, they count no more."""
        new_failures = recent
        if recent >= self._settings.passive_failures_to_fail:
            self._recent.acted_on(record.id)
        fresh = record.metrics_at > 0 and self._wall_clock() - record.metrics_at <= self._stale_after_s
        verdict = None
        for probe in probes:
            if probe is not None:
                self.stats.probes += 1
                self.stats.probe_failures += 0 if probe.ok else 1
            verdict = judge(seen.memory, record, probe, new_failures, self._settings, now, fresh)
            seen.memory, new_failures = verdict.memory, 0
        assert verdict is not None  # one probe at least
        seen.settled = (record, verdict) if verdict.remedy is Remedy.NONE and settled(verdict.memory) else None
        return verdict

    async def _confirmations(self, record: WorkerRecord, first: ProbeResult, needed: int) -> list[ProbeResult]:
        """A serving worker failed its ``first`` probe: the probes that confirm the failure, until ``needed`` failed
        in a row or one passed, each started ``CONFIRM_SHARE`` of the interval after the one before (those
        planned while the first was still out, ``_plan_early``, have started already): a dead or hung worker is
        ejected right after the probe that first finds it, not ``failures_to_fail`` rounds later (at 10,000
        workers a round takes 2 s or more). The results in the order the probes started, the first's first."""
        results = [first]
        early = self._early.get(record.id)
        if early is not None:
            early.stop_starting()
        last_start = asyncio.get_running_loop().time() - first.latency_s
        for started, confirmation in early.started if early is not None else ():
            results.append(await confirmation)
            last_start = started
            if results[-1].ok:
                return results
        while len(results) < needed and not results[-1].ok:
            await asyncio.sleep(max(0.0, last_start + self._spacing - asyncio.get_running_loop().time()))
            last_start = asyncio.get_running_loop().time()
            results.append(await self._prober.probe(record))  # no slot: see CONFIRM_SHARE
        return results

    def _plan_early(self, record: WorkerRecord, first_started: float) -> None:
        """The worker's probe is slow: plan the probes that would confirm its failure, to start while it is out."""
        if (needed := self._confirmations_needed(record)) > 1:
            early = _EarlyConfirmations(self._prober, record, needed - 1, self._spacing, self._early_budget,
                                        self.stats)
            self._early[record.id] = early
            early.begin(first_started)

    def _confirmations_needed(self, record: WorkerRecord) -> int:
        """How many failed probes in a row fail the worker now: 1 where no confirmation is due (it is not
        serving, it is new to the monitor, or the data path's failures decide)."""
        seen = self._seen.get(record.id)
        if seen is None or seen.memory.state not in HEALTHY or seen.registration[1] != record.registered_at:
            return 1
        if self._recent.recent(record.id, self._clock()) >= self._settings.passive_failures_to_fail:
            return 1
        return max(1, self._settings.failures_to_fail - seen.memory.failures)

    def _hold(self, record: WorkerRecord, slots: _Slots) -> _Held:
        """A probe starts in one of ``slots`` (taken already): it holds the slot until it is in (``_release``) or
        slow (``_look_at_slot``). A probe answered sooner costs one coarse timer (a heap entry), and nothing more."""
        loop = asyncio.get_running_loop()
        timers = self._timers[1] if self._timers is not None and self._timers[0] is loop else self._own_timers(loop)
        held = _Held(record, slots, loop.time())
        due = held.started + SLOT_HOLD_S
        held.timer = timers.call_at(due, self._look_at_slot, held, due, 1)
        return held

    def _look_at_slot(self, held: _Held, due: float, look: int) -> None:
        """The probe is still out at ``due``: its early confirmations are planned (the first look,
        ``_plan_early``), and it gives its slot back where the wait is the worker's: the loop kept time, or a probe
        started after it has been answered; or at the last look (``MAX_LOOKS``). Otherwise it looks again
        ``SLOT_HOLD_S`` later."""
        if look == 1:
            self._plan_early(held.record, held.started)
        assert self._timers is not None
        now = self._timers[0].time()
        if self._lingering < LINGER_LIMIT and (now - due <= LOOP_LATE_S or self._answered > held.started
                                               or look >= MAX_LOOKS):
            held.holding = False
            self._lingering += 1
            self.stats.slots_given_back += 1
            held.slots.release()
        else:
            held.timer = self._timers[1].call_at(now + SLOT_HOLD_S, self._look_at_slot, held, now + SLOT_HOLD_S,
                                                 look + 1)

    def _release(self, held: _Held, result: ProbeResult | None) -> None:
        """The probe is in: the slot it still holds goes back."""
        held.timer.cancel()
        if result is not None and result.latency_s < self._settings.probe_timeout_s:
            self._answered = max(self._answered, held.started)  # an answer (a timeout shows nothing of the loop)
        if held.holding:
            held.slots.release()
        else:
            self._lingering -= 1

    def _own_timers(self, loop: asyncio.AbstractEventLoop) -> CoarseTimers:
        self._timers = loop, coarse_timers()
        return self._timers[1]

    async def _write_until(self, done: asyncio.Event) -> None:
        """The state changes found so far, every ``write_every_s`` while a round runs and once more when it is
        ``done``: a worker found dead early in a long round leaves Envoy then, not when the round ends."""
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self._write_every_s)
            await self._write_states()

    async def _write_states(self) -> None:
        """The state changes found since the last write, in one batch (one announcement for all of them)."""
        changes, self._pending = self._pending, {}
        if not changes:
            return
        written = await self._store.set_states({worker_id: v.state for worker_id, (_, v) in changes.items()})
        self.stats.batches += 1
        for worker_id in written:
            record, verdict = changes[worker_id]
            before = self._written.get(worker_id, record.state)
            self._written[worker_id] = verdict.state
            key = f"{before.value}->{verdict.state.value}"
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
            log.info("worker %s: %s -> %s (%s)", record.id, before.value, verdict.state.value,
                     verdict.reason or "probe ok")

    async def _remedy(self, record: WorkerRecord, verdict: Verdict) -> None:
        if verdict.remedy is not Remedy.NONE:
            self.stats.remedies[verdict.remedy.value] = self.stats.remedies.get(verdict.remedy.value, 0) + 1
            log.warning("worker %s: %s (%s)", record.id, verdict.remedy.value, verdict.reason)
            if self._remediator is not None:
                await self._remediator.remedy(record.id, verdict.remedy, verdict.reason)


class _Held:
    """A probe's hold on its round's slot (``HealthMonitor._hold``)."""

    __slots__ = ("holding", "record", "slots", "started", "timer")

    def __init__(self, record: WorkerRecord, slots: _Slots, started: float) -> None:
        self.record = record
        self.slots = slots
        self.started = started
        self.holding = True
        self.timer: CoarseTimer


class _Budget:
    """Early confirmations in flight, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self) -> bool:
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def give(self, _: object = None) -> None:
        self.used -= 1


class _EarlyConfirmations:
    """The probes that confirm a slow first probe while it is still out: ``begin`` (the first is slow) plans up
    to ``count``, ``spacing`` apart from its start; each starts if the first is still out and ``budget`` has
    room when it is due."""

    def __init__(self, prober: Prober, record: WorkerRecord, count: int, spacing: float, budget: _Budget,
                 stats: MonitorStats) -> None:
        self._prober = prober
        self._record = record
        self._count = count
        self._spacing = spacing
        self._budget = budget
        self._stats = stats
        self._timers: list[asyncio.TimerHandle] = []
        self.started: list[tuple[float, asyncio.Task[ProbeResult]]] = []
        """(when, probe) of each confirmation started, in order."""

    def begin(self, first_started: float) -> None:
        loop = asyncio.get_running_loop()
        for k in range(1, self._count + 1):
            self._timers.append(loop.call_at(max(first_started + k * self._spacing, loop.time()), self._start))

    def _start(self) -> None:
        if not self._budget.take():
            self.stop_starting()  # the rest follow the first's verdict, one after the other
            return
        self._stats.early_confirmations += 1
        probe = asyncio.get_running_loop().create_task(self._prober.probe(self._record))
        probe.add_done_callback(self._budget.give)
        self.started.append((asyncio.get_running_loop().time(), probe))

    def stop_starting(self) -> None:
        for timer in self._timers:
            timer.cancel()

    def cancel(self) -> None:
        self.stop_starting()
        for _, probe in self.started:
            probe.cancel()


class _Slots:
    """Probes in flight at most: ``asyncio.Semaphore`` without its fairness check, which walked its waiters on
    every acquire (6 % of the monitor's CPU at 10,000 workers). A slot given back goes straight to the longest
    waiter."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """A free slot now, if there is one (no coroutine to run: the round's every probe asks)."""
        if self._free > 0:  # (never while someone waits: a slot given back goes to a waiter first)
            self._free -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.take():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # it was handed a slot as it was cancelled: pass the slot on
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


class _FirstProbes:
    """The workers whose first probe of the round is still out; ``all_in`` returns once there is none (a set, not
    a future per check and an ``asyncio.wait`` over all 10,000)."""

    def __init__(self) -> None:
        self._out: set[str] = set()
        self._none_out = asyncio.Event()
        self._none_out.set()

    def add(self, worker_id: str) -> None:
        self._out.add(worker_id)
        self._none_out.clear()

    def done(self, worker_id: str) -> None:
        """(Told again, or of a worker it was never told of, it does nothing.)"""
        self._out.discard(worker_id)
        if not self._out:
            self._none_out.set()

    async def all_in(self) -> None:
        await self._none_out.wait()


async def run_monitor(monitor: HealthMonitor, interval_s: float, stop: asyncio.Event | None = None,
                      passive_watch_s: float = PASSIVE_WATCH_S) -> None:
    """Rounds every ``interval_s`` (a round that overruns is followed at once by the next), and beside them a
    look at the data path's failure counts every ``passive_watch_s``."""
    stop = stop or asyncio.Event()
    redis = OutageLog(log, "redis unreachable (%s); worker states are not updated",
                      "redis reachable again; health monitor resumed")

    async def step() -> None:
        await monitor.round()
        redis.up()

    try:
        async with asyncio.TaskGroup() as loops:
            loops.create_task(every(interval_s, stop, step, redis.down, count_step=True))
            loops.create_task(every(passive_watch_s, stop, monitor.watch, redis.down))
    finally:
        monitor.cancel_checks()
