"""The priority queue of requests waiting for capacity: the discipline only, pure, with an injected clock.

Order of release:

1. priority classes in strict order (class 0 first);
2. inside a class, weighted fair share across tenants by tokens: start-time fair queueing. Each backlogged
   tenant has a start tag; the tenant with the smallest goes next and its tag grows by the request's tokens
   divided by the tenant's weight. A tenant that was idle starts at the class's current virtual time, so
   idleness earns no credit to burst with later;
3. inside a tenant, deadline-aware and short-prefill-first. With ``p`` the request's predicted prefill
   (seconds of the prompt part no worker's cache holds), ``d`` its deadline (arrival + its class's
   ``max_wait_s`` W) and ``now`` the clock:

       slack  = d − now − p
       urgent = slack ≤ URGENT_SHARE × W
       key    = (0, slack)          if urgent      (least slack first: it is about to miss its deadline)
              = (1, p, arrival)     otherwise      (shortest prefill first, then first in, first out)

   so a short interactive request overtakes long prefills queued before it, and a long one waits at most
   about (1 − URGENT_SHARE) × W − p before it goes ahead of every short one. Fair shares and classes are
   untouched: the ordering only chooses which of a tenant's own requests uses the tenant's turn.

Requests wait for capacity of a *domain* (the model and the pools the tenant may use): a release pass skips
the rest of a domain once its first candidate does not fit (a full model never holds up another, and a
request that is next by the order above is not overtaken by a later one of its own domain that happens to
fit). The queue is bounded; on overflow the newest request of the lowest class is shed (the arriving one
when its class is the lowest present).

Cost: a candidate is the minimum of its flow's keys, a scan of that tenant's backlog (``max_queued`` bounds
it; a pass that places k requests from a backlog of n does O(k · n) key computations).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

URGENT_SHARE = 0.5
"""A held request whose slack is below this share of its class's wait bound goes before shorter ones."""


@dataclass(eq=False, slots=True)
class QueueEntry:
    domain: Hashable
    tenant: str
    priority: int
    tokens: int
    weight: float
    enqueued_at: float
    deadline: float
    sequence: int
    prefill_s: float = 0.0
    """Predicted prefill of its uncached prompt part, seconds (orders requests inside a tenant)."""
    payload: Any = None
    """What the owner attaches (the service: the request's state)."""


@dataclass(slots=True)
class _Flow:
    """One tenant's backlog inside one class."""

    entries: deque[QueueEntry] = field(default_factory=deque)
    start: float = 0.0
    """Virtual start tag of its head entry."""


class _Class:
    __slots__ = ("flows", "size", "virtual_time")

    def __init__(self) -> None:
        self.flows: dict[str, _Flow] = {}
        self.virtual_time = 0.0
        self.size = 0


@dataclass(frozen=True, slots=True)
class Pushed:
    entry: QueueEntry | None
    """The new entry; None when the queue was full and the request itself is shed."""
    shed: tuple[QueueEntry, ...] = ()
    """Entries pushed out to make room (lower class than the new one)."""


class FlowQueue:
    def __init__(self, max_wait_s: Sequence[float], max_entries: int, clock: Callable[[], float]) -> None:
        """``max_wait_s``: the deadline of each class, highest class first."""
        self.max_wait_s = tuple(max_wait_s)
        self.max_entries = max_entries
        self._clock = clock
        self._classes = [_Class() for _ in self.max_wait_s]
        self._size = 0
        self._sequence = 0
        self._domains: dict[Hashable, int] = {}
        self._held: dict[tuple[Hashable, int], int] = {}
        """(domain, class) → entries waiting."""

    def __len__(self) -> int:
        return self._size

    def has_waiting(self, domain: Hashable) -> bool:
        return self._domains.get(domain, 0) > 0

    def push(self, domain: Hashable, tenant: str, priority: int, tokens: int, weight: float = 1.0,
             payload: Any = None, prefill_s: float = 0.0, max_wait_s: float | None = None) -> Pushed:
        """``max_wait_s`` overrides the class's deadline (a cold start waits longer than capacity does)."""
        shed: list[QueueEntry] = []
        if self._size >= self.max_entries:
            lowest = self._lowest_class()
            if lowest is None or lowest <= priority:
                return Pushed(None)
            shed.append(self._newest(lowest))
            self.remove(shed[0])
        now = self._clock()
        self._sequence += 1
        wait = self.max_wait_s[priority] if max_wait_s is None else max_wait_s
        entry = QueueEntry(domain, tenant, priority, max(1, tokens), weight, now, now + wait, self._sequence,
                           max(0.0, prefill_s), payload)
        cls = self._classes[priority]
        flow = cls.flows.get(tenant)
        if flow is None:
            flow = cls.flows[tenant] = _Flow(start=cls.virtual_time)
        elif not flow.entries:
            flow.start = max(flow.start, cls.virtual_time)
        flow.entries.append(entry)
        cls.size += 1
        self._size += 1
        self._domains[domain] = self._domains.get(domain, 0) + 1
        self._held[domain, priority] = self._held.get((domain, priority), 0) + 1
        return Pushed(entry, tuple(shed))

    def next_candidate(self, blocked: Iterable[Hashable] = ()) -> QueueEntry | None:
        """The entry to try next, skipping domains already found full in this pass. Does not remove it."""
        skip = blocked if isinstance(blocked, set | frozenset) else set(blocked)
        now = self._clock()
        for priority, cls in enumerate(self._classes):
            if not cls.size:
                continue
            urgent_s = URGENT_SHARE * self.max_wait_s[priority]
            best: QueueEntry | None = None
            best_start = 0.0
            for flow in cls.flows.values():
                if not flow.entries or (best is not None and flow.start >= best_start):
                    continue
                chosen = _first_in_order(flow.entries, skip, now, urgent_s)
                if chosen is not None:
                    best, best_start = chosen, flow.start
            if best is not None:
                return best
        return None

    def take(self, entry: QueueEntry) -> None:
        """The entry is placed: remove it and charge its tenant's share."""
        cls = self._classes[entry.priority]
        flow = cls.flows[entry.tenant]
        cls.virtual_time = max(cls.virtual_time, flow.start)
        flow.start += entry.tokens / entry.weight
        self._discard(entry)

    def remove(self, entry: QueueEntry) -> bool:
        """Drop an entry without charging (cancelled, expired or shed); False when it was not queued."""
        flow = self._classes[entry.priority].flows.get(entry.tenant)
        if flow is None or entry not in flow.entries:
            return False
        self._discard(entry)
        return True

    def expired(self) -> list[QueueEntry]:
        """Entries whose deadline has passed (still queued; the owner answers and removes them)."""
        now = self._clock()
        return [e for cls in self._classes for flow in cls.flows.values() for e in flow.entries if e.deadline <= now]

    def held_by_domain(self) -> Mapping[Hashable, int]:
        """Domain → entries waiting (a copy; read off the request path by the queue-depth publisher)."""
        return dict(self._domains)

    def best_waiting(self) -> Mapping[Hashable, int]:
        """Domain → the highest class (lowest number) waiting for it: what this replica tells the others
        (``queue_order``)."""
        best: dict[Hashable, int] = {}
        for domain, priority in self._held:
            if priority < best.get(domain, priority + 1):
                best[domain] = priority
        return best

    def is_urgent(self, entry: QueueEntry) -> bool:
        """Whether the entry is near its deadline by the release order's rule (least slack first)."""
        return release_key(entry, self._clock(), URGENT_SHARE * self.max_wait_s[entry.priority])[0] == 0

    def depth(self) -> Mapping[tuple[int, str], int]:
        """(class, tenant) → entries waiting."""
        return {(priority, tenant): len(flow.entries) for priority, cls in enumerate(self._classes)
                for tenant, flow in cls.flows.items() if flow.entries}

    def _discard(self, entry: QueueEntry) -> None:
        cls = self._classes[entry.priority]
        cls.flows[entry.tenant].entries.remove(entry)
        cls.size -= 1
        self._size -= 1
        left = self._domains[entry.domain] - 1
        if left:
            self._domains[entry.domain] = left
        else:
            del self._domains[entry.domain]
        held = (entry.domain, entry.priority)
        if self._held[held] > 1:
            self._held[held] -= 1
        else:
            del self._held[held]

    def _lowest_class(self) -> int | None:
        for priority in range(len(self._classes) - 1, -1, -1):
            if self._classes[priority].size:
                return priority
        return None

    def _newest(self, priority: int) -> QueueEntry:
        flows = self._classes[priority].flows.values()
        return max((flow.entries[-1] for flow in flows if flow.entries), key=lambda e: e.sequence)


def release_key(entry: QueueEntry, now: float, urgent_s: float) -> tuple[int, float, float]:
    """Order inside a tenant (module docstring): urgent by slack, else shortest prefill, then arrival."""
    slack = entry.deadline - now - entry.prefill_s
    if slack <= urgent_s:
        return (0, slack, float(entry.sequence))
    return (1, entry.prefill_s, float(entry.sequence))


def _first_in_order(entries: Iterable[QueueEntry], skip: set[Hashable] | frozenset[Hashable], now: float,
                    urgent_s: float) -> QueueEntry | None:
    best: QueueEntry | None = None
    best_key = (2, 0.0, 0.0)
    for entry in entries:
        if entry.domain in skip:
            continue
        key = release_key(entry, now, urgent_s)
        if key < best_key:
            best, best_key = entry, key
    return best
