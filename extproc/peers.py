"""What extproc replicas tell each other through Redis so their picks agree: who is alive, the KV and
prefill reservations each holds per worker, the best class each holds waiting per pool (in-flight counts
travel as deltas: ``inflight``).

Keys (named in ``poolgate.kernel.keys.PeerKeys``; the store runs the pipelines):

- ``{prefix}:extproc:replicas`` hash: replica id → wall-clock time of its last write. A replica writes it at
  least every ``PRESENCE_REFRESH_S``; readers count replicas seen within ``PRESENCE_TTL_S`` (a killed one
  stops counting after that), and a replica that stops cleanly removes itself.
- ``{prefix}:extproc:reserved`` hash: ``"worker replica"`` → ``"kv prefill stamp requests"``, a replica's
  whole current reservation on a worker and how many of its requests there are unsettled (absolute, so a
  lost or repeated write heals at the next one). Written when it changes (batched with the in-flight
  deltas), removed at zero, so one read costs the workers that hold reservations, not the fleet; a field
  older than ``PRESENCE_TTL_S`` is ignored (its replica died holding it) and removed by the next replica
  that reads it, and the hash expires after it unless renewed.
- ``{prefix}:extproc:affinity`` stream: one entry per write that has new placement hints (``r`` the replica,
  ``d`` JSON ``[[key, worker], …]`` its new affinity records, a session key as a list, and ``p`` JSON
  ``[[worker, [block key, …]], …]`` the prompt blocks its placements made pending on their workers, the ones
  new there: ``placed_prefixes``), capped near ``AFFINITY_LOG_ENTRIES``. Each replica reads the entries after
  the last one it saw, applies the others' records to its map and counts their blocks pending in its KV
  index (``on_placed``).
- ``{prefix}:extproc:waiting`` hash: replica id → JSON ``[stamp, {pool: class}]``, the best priority class
  the replica holds waiting per pool (``queue_order``). Written when it changes and every
  ``REPORT_REFRESH_S`` while non-empty, removed when empty; readers ignore one older than ``REPORT_TTL_S``.

Nothing here runs on the pick: the watcher's flush loop writes, its refresh reads (one pipeline each).

Sibling processes (``siblings``) tell each other their reservations at once; what Redis holds of a sibling
is left out, and what it told is added instead (``merge``, at each read and whenever a sibling tells news).
While every live replica is a sibling, the book's unseen window is ``siblings.SIBLING_EXCHANGE_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from typing import Any

import orjson

from extproc.affinity import AffinityMap
from extproc.placed_prefixes import PlacedPrefixes
from extproc.prefill_ledger import Unsettled, placed_since
from extproc.queue_order import REPORT_REFRESH_S, REPORT_TTL_S, QueueOrder
from extproc.reservations import ReservationBook
from extproc.siblings import SIBLING_EXCHANGE_S, Siblings
from poolgate.kernel.keys import PeerKeys

PRESENCE_REFRESH_S = 1.0
PRESENCE_TTL_S = 5.0
AFFINITY_LOG_ENTRIES = 10_000
"""Entries the affinity stream keeps (each one replica's records of one write, ~20 ms of its placements)."""
AFFINITY_READ_ENTRIES = 10_000


class PeerExchange:
    """This replica's side of the exchange over one ``ReservationBook``."""

    def __init__(self, keys: PeerKeys, replica_id: str, book: ReservationBook,
                 clock: Callable[[], float] = time.time, affinity: AffinityMap | None = None,
                 queue_order: QueueOrder | None = None, siblings: Siblings | None = None,
                 placed_prefixes: PlacedPrefixes | None = None,
                 on_placed: Callable[[str, Sequence[int]], None] | None = None) -> None:
        """``placed_prefixes``: this replica's new pending prompt blocks, to write; ``on_placed(worker, keys)``:
        what to do with the others' (count them pending in the KV index)."""
        self._keys = keys
        self.replica_id = replica_id
        self._book = book
        self._clock = clock
        self._affinity = affinity
        self._placed_prefixes = placed_prefixes
        self._on_placed = on_placed
        self._affinity_seen = f"{int((clock() - 1.0) * 1000)}-0"
        """Last hints entry read; a replica starts with what was written from a second before it started (still
        fresh hints; and an entry written in the millisecond it started, whose id is that millisecond's, is not
        skipped)."""
        self._published: dict[str, tuple[int, int, int]] = {}
        self._present_at = float("-inf")
        self._queue_order = queue_order
        self._reported: dict[str, int] = {}
        self._reported_at = float("-inf")
        self.replicas = 1
        """Live replicas at the last read, this one included."""
        self._dead_fields: list[str] = []
        """Reservations of replicas that died holding them, seen at the last read; removed at the next beat."""
        self._peer_prefill: dict[tuple[str, str], Unsettled] = {}
        """(Worker id, replica) → the other replicas' unsettled placements at the last read (what they placed
        since is the increase: ``prefill_ledger.placed_since``)."""
        self._siblings = siblings
        self._redis_exchange_s = book.exchange_s
        self._live: set[str] = {replica_id}
        """The replicas Redis last showed alive, this one included."""
        self._remote: dict[tuple[str, str], tuple[int, int, int]] = {}
        """(Worker id, replica) → the (KV, prefill, unsettled requests) reservations Redis last showed of
        replicas not siblings."""

    def _pending(self) -> tuple[float, dict[str, tuple[int, int, int]], dict[str, tuple[int, int, int]], list[str],
                                bool]:
        """Now, the current reservations, those changed since the last write, those gone, presence beat due."""
        now = self._clock()
        current = self._book.own_reservations()
        changed = {w: v for w, v in current.items() if self._published.get(w) != v}
        gone = [w for w in self._published if w not in current]
        return now, current, changed, gone, now - self._present_at >= PRESENCE_REFRESH_S

    def has_writes(self) -> bool:
        """Whether ``queue_writes`` would write anything now."""
        _, _, changed, gone, due = self._pending()
        return bool(changed or gone or due or self._has_hints() or self._report_due(self._clock()) is not None)

    def _has_hints(self) -> bool:
        return ((self._affinity is not None and self._affinity.has_unpublished)
                or (self._placed_prefixes is not None and self._placed_prefixes.has_unsent))

    def _report_due(self, now: float) -> dict[str, int] | None:
        """The queue report to write now (changed, or non-empty and due for its refresh); None: nothing to write."""
        if self._queue_order is None:
            return None
        report = self._queue_order.report()
        if report != self._reported or (report and now - self._reported_at >= REPORT_REFRESH_S):
            return report
        return None

    def queue_writes(self, pipe: Any) -> Callable[[], None] | None:
        """Queue the changed reservations (and the presence beat when due) on ``pipe``; None when nothing is
        to write, else a callback to run once the pipeline succeeded."""
        now, current, changed, gone, due = self._pending()
        hints = self._queue_hints(pipe)
        report = self._queue_report(pipe, now)
        if not (changed or gone or due):
            return (lambda: None) if hints or report else None
        written_now = current if due else changed
        if written_now:
            pipe.hset(self._keys.reserved, mapping={self._field(worker_id): f"{kv} {prefill} {now:.3f} {requests}"
                                                    for worker_id, (kv, prefill, requests) in written_now.items()})
            pipe.pexpire(self._keys.reserved, int(PRESENCE_TTL_S * 1000))
        dropped = [self._field(worker_id) for worker_id in gone] + (self._dead_fields if due else [])
        if dropped:
            pipe.hdel(self._keys.reserved, *dropped)
        if due:
            self._dead_fields = []
            pipe.hset(self._keys.replicas, self.replica_id, f"{now:.3f}")

        def written() -> None:
            self._published = current
            if due:
                self._present_at = now
        return written

    def _queue_report(self, pipe: Any, now: float) -> bool:
        """Queue this replica's best class waiting per pool when due (kept as written even if the write fails:
        the periodic rewrite repeats it, and a reader ignores a stale one)."""
        report = self._report_due(now)
        if report is None:
            return False
        if report:
            pipe.hset(self._keys.waiting, self.replica_id, orjson.dumps([round(now, 3), report]))
            pipe.pexpire(self._keys.waiting, int(PRESENCE_TTL_S * 1000))
        else:
            pipe.hdel(self._keys.waiting, self.replica_id)
        self._reported, self._reported_at = report, now
        return True

    def _queue_hints(self, pipe: Any) -> bool:
        """Queue this replica's new affinity records and pending prompt blocks, if any (lost if the write
        fails: they are only hints)."""
        if not self._has_hints():
            return False
        records = ([[list(k) if isinstance(k, tuple) else k, w] for k, w in self._affinity.take_unpublished()]
                   if self._affinity is not None else [])
        blocks = ([[w, list(keys)] for w, keys in self._placed_prefixes.take()]
                  if self._placed_prefixes is not None else [])
        pipe.xadd(self._keys.affinity, {"r": self.replica_id, "d": orjson.dumps(records), "p": orjson.dumps(blocks)},
                  maxlen=AFFINITY_LOG_ENTRIES, approximate=True)
        return True

    def queue_reads(self, pipe: Any, known: Container[str]) -> Callable[[list[Any]], None]:
        """Queue the reads of the replicas, the workers' reservations, the new affinity records and the queue
        reports; the callback takes the pipeline's results for them (in order), hands the other replicas'
        totals on ``known`` workers to the book (with this replica's rank among the live ones, which decides
        its turns on the workers, the time of the read, and the prefill each placed since the last read, for
        the prefill ledger), their affinity records to the map and their best classes waiting to the order."""
        pipe.hgetall(self._keys.replicas)
        pipe.hgetall(self._keys.reserved)
        hints = self._affinity is not None or self._on_placed is not None
        if hints:
            pipe.xread({self._keys.affinity: self._affinity_seen}, count=AFFINITY_READ_ENTRIES)
        if self._queue_order is not None:
            pipe.hgetall(self._keys.waiting)

        def apply(results: list[Any]) -> None:
            if self._queue_order is not None:
                self._queue_order.apply(self._best_elsewhere(results.pop()))
            if hints:
                self._apply_hints(results.pop())
            oldest = self._clock() - PRESENCE_TTL_S
            replicas = {_text(r) for r, at in results[0].items() if _stamp(at) >= oldest}
            replicas.add(self.replica_id)
            siblings = self._siblings.ids if self._siblings is not None else frozenset()
            remote: dict[tuple[str, str], tuple[int, int, int]] = {}
            dead: list[str] = []
            for field, value in results[1].items():
                worker_id, _, replica = _text(field).partition(" ")
                if replica == self.replica_id or replica in siblings:
                    continue
                parsed = _reservation(value, oldest)
                if parsed is None:
                    dead.append(_text(field))
                elif worker_id in known:
                    remote[worker_id, replica] = parsed
            self._dead_fields = dead
            self._live, self._remote = replicas, remote
            self.merge()
        return apply

    def merge(self) -> None:
        """Hand the book the other replicas' reservations: Redis's of the replicas on other hosts, and what
        the siblings told; with the replica count, this replica's rank among them, and the prefill each
        placed since the last merge (for the prefill ledger)."""
        replicas = set(self._live)
        parts = [(w, r, k, p, n) for (w, r), (k, p, n) in self._remote.items()]
        if self._siblings is not None:
            parts.extend((w, r, k, p, n) for r, w, k, p, n in self._siblings.view.reservations())
            replicas |= self._siblings.ids
            alone_here = replicas <= self._siblings.ids | {self.replica_id}
            self._book.exchange_s = SIBLING_EXCHANGE_S if alone_here else self._redis_exchange_s
        kv, prefill, by_replica = summed(parts)
        placed = placed_since(self._peer_prefill, by_replica)
        self._peer_prefill = by_replica
        self.replicas = len(replicas)
        self._book.apply_peers(kv, prefill, self.replicas, rank=sorted(replicas).index(self.replica_id),
                               at=self._clock(), placed=placed)

    def _best_elsewhere(self, reports: Any) -> dict[str, int]:
        """Pool → the best class the other replicas' fresh reports hold waiting (malformed ones are skipped)."""
        oldest = self._clock() - REPORT_TTL_S
        best: dict[str, int] = {}
        for replica, value in (reports or {}).items():
            if _text(replica) == self.replica_id:
                continue
            try:
                stamp, pools = orjson.loads(value)
                fresh = float(stamp) >= oldest
                waiting = [(str(pool), int(priority)) for pool, priority in pools.items()] if fresh else []
            except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
                continue
            for pool, priority in waiting:
                if priority < best.get(pool, priority + 1):
                    best[pool] = priority
        return best

    def _apply_hints(self, streams: Any) -> None:
        """The other replicas' affinity records and pending prompt blocks from an XREAD answer (its own are
        skipped)."""
        for _, entries in streams or ():
            for entry_id, fields in entries:
                self._affinity_seen = _text(entry_id)
                fields = {_text(k): v for k, v in fields.items()}
                if _text(fields.get("r", b"")) == self.replica_id:
                    continue
                if self._affinity is not None:
                    self._affinity.apply(_records(fields.get("d", b"[]")))
                if self._on_placed is not None:
                    for worker_id, keys in _placed_blocks(fields.get("p", b"[]")):
                        self._on_placed(worker_id, keys)

    def queue_leave(self, pipe: Any) -> None:
        """Remove this replica's presence and reservations (a clean stop; a killed one fades by TTL)."""
        pipe.hdel(self._keys.replicas, self.replica_id)
        pipe.hdel(self._keys.waiting, self.replica_id)
        if self._published:
            pipe.hdel(self._keys.reserved, *map(self._field, self._published))

    def _field(self, worker_id: str) -> str:
        """This replica's field for a worker (worker ids hold no space: the registry's pattern)."""
        return f"{worker_id} {self.replica_id}"


def summed(parts: Iterable[tuple[str, str, int, int, int]]) -> (
        tuple[dict[str, int], dict[str, int], dict[tuple[str, str], Unsettled]]):
    """The other replicas' reservations from (worker id, replica, KV, prefill, unsettled requests): their KV and
    prefill summed per worker (for the book), and each one's unsettled placements per worker (for
    ``prefill_ledger.placed_since``)."""
    kv: dict[str, int] = {}
    prefill: dict[str, int] = {}
    by_replica: dict[tuple[str, str], Unsettled] = {}
    for worker_id, replica, kv_tokens, prefill_tokens, requests in parts:
        kv[worker_id] = kv.get(worker_id, 0) + kv_tokens
        prefill[worker_id] = prefill.get(worker_id, 0) + prefill_tokens
        by_replica[worker_id, replica] = Unsettled(prefill_tokens, requests)
    return kv, prefill, by_replica


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _records(data: bytes | str) -> list[tuple[Hashable, str]]:
    """Decoded ``[[key, worker], …]``; a list key is a tuple again (a session key); malformed ones are skipped."""
    try:
        records = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    decoded: list[tuple[Hashable, str]] = []
    for record in records if isinstance(records, list) else ():
        if isinstance(record, list) and len(record) == 2 and isinstance(record[1], str):
            key = record[0]
            decoded.append((tuple(key) if isinstance(key, list) else key, record[1]))
    return decoded


def _placed_blocks(data: bytes | str) -> list[tuple[str, list[int]]]:
    """Decoded ``[[worker, [block key, …]], …]``; malformed ones are skipped."""
    try:
        placed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    decoded: list[tuple[str, list[int]]] = []
    for entry in placed if isinstance(placed, list) else ():
        if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
                and all(isinstance(key, int) for key in entry[1])):
            decoded.append((entry[0], entry[1]))
    return decoded


def _stamp(value: bytes | str) -> float:
    try:
        return float(_text(value))
    except ValueError:
        return float("-inf")


def _reservation(value: bytes | str, oldest: float) -> tuple[int, int, int] | None:
    """``"kv prefill stamp requests"`` written since ``oldest``, else None (also for a malformed value); a
    value without its requests (an older replica's) counts as one request where its prefill grows."""
    parts = _text(value).split()
    try:
        kv, prefill, stamp = int(parts[0]), int(parts[1]), float(parts[2])
        requests = int(parts[3]) if len(parts) > 3 else 0
    except (IndexError, ValueError):
        return None
    return (max(0, kv), max(0, prefill), max(0, requests)) if stamp >= oldest else None

