"""The extproc processes of one host, told of each other's placements before their next pick.

Several processes behind one Envoy (``extproc.processes``) share what they placed through Redis (``peers``),
which another process's pick sees one flush batch plus one refresh later, ~120 ms. On a cold fleet that is
long: a process sends a document to a worker that another process sent elsewhere 50 ms before, and both
engines compute it. In the virtual-time lab (``bench lab --processes 1,2,4 --siblings --exchange-s 0.14``,
H100 shared documents, Poisson, 85 %) one process answers at p99 0.362 s, two exchanging through Redis
alone at 0.892 s, two telling each other as below at 0.390 s (four: 0.868 and 0.413 s).

So the processes one ``poolgate up`` starts also tell each other every change at once, over local datagrams
(Linux abstract Unix sockets named by each process's gRPC port: no file on disk, gone with the process),
and each process reads what arrived just before each pick (non-blocking, a few µs per datagram) and in the
background. A datagram holds:

- the sender's whole reservation on each worker where it changed (absolute, as in Redis, so a lost datagram
  heals at the next change there or at the beat, which repeats them all every ``BEAT_S``);
- the sender's own in-flight count on each worker where it changed, and how much of it the sender has
  written to Redis (so the Redis total is not counted twice);
- for a placement, its affinity records and the prompt's blocks now pending on its worker (the KV index),
  so a second request for the same new prefix follows the first to the same worker.

What a sibling tells this way replaces what Redis says of it (``PeerExchange`` leaves its fields out). A
sibling not heard from for ``SILENT_S`` is forgotten (a killed one; its Redis fields fade alike). Replicas
on other hosts still go through Redis, and while there are any, ``exchange_s`` stays Redis's bound; among
siblings alone it is ``SIBLING_EXCHANGE_S``: what a sibling placed is in this process's view before its
next pick, so only picks running at the same moment on two cores go unseen.

Nothing here blocks: a send to a full or absent socket is dropped (the beat repeats it), a receive stops at
the first empty read.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import orjson

from extproc.inflight import InflightTracker
from extproc.reservations import ReservationBook

log = logging.getLogger(__name__)

BEAT_S = 1.0
"""Every sibling repeats its whole state this often (heals a lost datagram; says it is alive)."""
SILENT_S = 5.0
"""A sibling not heard from for this long is forgotten (killed): as a replica's Redis presence fades."""
SIBLING_EXCHANGE_S = 0.005
"""How long a sibling's placement may stay unseen here: a pick running meanwhile on the other core (the
slowest picks take ~1 ms), with a margin. The reservation book's turns then last 20 ms."""
MAX_PENDING_KEYS = 4096
"""A placement's prompt blocks sent as pending, from the first (64k tokens at 16-token blocks): the start
of a prompt is what a later one shares; the cap keeps a datagram far under the socket's buffer."""


def address(port: int) -> bytes:
    """The abstract socket name of the extproc process serving gRPC on ``port``."""
    return b"\0poolgate-extproc-siblings-" + str(port).encode()


Counts = tuple[int, ...]
"""A process's figures on one worker: reservations (KV, prefill, unsettled requests), in-flight (local, written)."""
NO_RESERVATION: Counts = (0, 0, 0)
NO_INFLIGHT: Counts = (0, 0)


@dataclass
class Placed:
    """What one placement adds besides reservations: where its prompt's blocks are pending, its affinity."""

    worker_id: str
    pending_keys: Sequence[int]
    affinity: Sequence[tuple[Hashable, str]]


@dataclass
class News:
    """One datagram, decoded: a sibling's state where it changed, and the placements since its last one."""

    sender: str
    reservations: dict[str, Counts]
    """Worker id → (KV, prefill, unsettled requests) (``ReservationBook.own_reservations``)."""
    inflight: dict[str, Counts]
    placed: list[Placed]
    whole: bool
    """A beat: every reservation and in-flight count the sender holds (workers absent hold nothing)."""


def encode(news: News) -> bytes:
    placed = [[p.worker_id, list(p.pending_keys[:MAX_PENDING_KEYS]),
               [[list(k) if isinstance(k, tuple) else k, w] for k, w in p.affinity]] for p in news.placed]
    return orjson.dumps([news.sender, news.whole, news.reservations, news.inflight, placed])


def decode(data: bytes) -> News | None:
    """None for a malformed datagram (never from a sibling of the same version; skipped)."""
    try:
        sender, whole, reservations, inflight, placed = orjson.loads(data)
        return News(
            sender=str(sender), whole=bool(whole),
            reservations={str(w): (int(kv), int(prefill), int(requests))
                          for w, (kv, prefill, requests) in reservations.items()},
            inflight={str(w): (int(local), int(flushed)) for w, (local, flushed) in inflight.items()},
            placed=[Placed(str(w), [int(k) for k in keys],
                           [(tuple(k) if isinstance(k, list) else k, str(target)) for k, target in affinity])
                    for w, keys, affinity in placed])
    except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
        return None


class SiblingSocket:
    """One process's datagram socket and its siblings' addresses."""

    def __init__(self, own_port: int, sibling_ports: Iterable[int]) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._socket.bind(address(own_port))
        self._peers = [address(p) for p in sibling_ports if p != own_port]

    def fileno(self) -> int:
        return self._socket.fileno()

    def send(self, data: bytes) -> int:
        """To every sibling that listens; returns how many took it (an absent or full one drops it)."""
        sent = 0
        for peer in self._peers:
            try:
                self._socket.sendto(data, peer)
                sent += 1
            except OSError:  # not started yet, stopped, or its buffer full: the beat repeats the state
                continue
        return sent

    def receive(self) -> list[bytes]:
        received: list[bytes] = []
        while True:
            try:
                received.append(self._socket.recv(1 << 20))
            except OSError:  # nothing more waiting (BlockingIOError), or the socket closed
                return received

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()


@dataclass
class Heard:
    """What this process knows of one sibling."""

    at: float
    reservations: dict[str, Counts] = field(default_factory=dict)
    inflight: dict[str, Counts] = field(default_factory=dict)


class SiblingView:
    """The siblings' state as their datagrams told it. Pure: no socket, a clock passed in."""

    def __init__(self) -> None:
        self.heard: dict[str, Heard] = {}

    def take(self, news: News, now: float) -> None:
        heard = self.heard.get(news.sender)
        if heard is None:
            log.info("extproc sibling %s heard: its placements count here before each pick", news.sender)
        if heard is None or news.whole:
            heard = self.heard[news.sender] = Heard(now)
        heard.at = now
        _update(heard.reservations, news.reservations)
        _update(heard.inflight, news.inflight)

    def forget_silent(self, now: float) -> bool:
        """Drop the siblings not heard from for ``SILENT_S``; whether any was dropped."""
        silent = [s for s, heard in self.heard.items() if heard.at < now - SILENT_S]
        for sender in silent:
            del self.heard[sender]
            log.warning("extproc sibling %s silent for %.0f s: its reservations no longer count", sender, SILENT_S)
        return bool(silent)

    def reservations(self) -> Iterable[tuple[str, str, int, int, int]]:
        """(Sibling, worker id, KV tokens, prefill tokens, unsettled requests) of every reservation the siblings
        hold."""
        for sender, heard in self.heard.items():
            for worker_id, (kv, prefill, requests) in heard.reservations.items():
                yield sender, worker_id, kv, prefill, requests

    def inflight(self) -> tuple[dict[str, int], dict[str, int]]:
        """Worker id → the siblings' in-flight requests there, and → how many of them they wrote to Redis."""
        local: dict[str, int] = {}
        flushed: dict[str, int] = {}
        for heard in self.heard.values():
            for worker_id, (count, written) in heard.inflight.items():
                local[worker_id] = local.get(worker_id, 0) + count
                flushed[worker_id] = flushed.get(worker_id, 0) + written
        return local, flushed


def _update(held: dict[str, Counts], changes: Mapping[str, Counts]) -> None:
    """A sibling's per-worker state with its changes in (a worker changed to all zeros holds nothing)."""
    for worker_id, value in changes.items():
        if any(value):
            held[worker_id] = value
        else:
            held.pop(worker_id, None)


class Outbox:
    """What this process has told its siblings, so the next datagram holds only what changed."""

    def __init__(self) -> None:
        self._told: tuple[dict[str, Counts], dict[str, Counts]] = ({}, {})

    def news(self, sender: str, state: tuple[Mapping[str, Counts], Mapping[str, Counts]],
             placed: list[Placed], whole: bool, only: Collection[str] | None = None) -> News | None:
        """The datagram to send now (None: nothing changed, nothing placed, no beat due). ``state``: this
        process's (reservations, in-flight) per worker, of the ``only`` workers when given (a placement or a
        release looks at its own workers, not the fleet)."""
        changes = [_changes(told, now, nothing, whole, only)
                   for told, now, nothing in zip(self._told, state, (NO_RESERVATION, NO_INFLIGHT), strict=True)]
        if not (changes[0] or changes[1] or placed or whole):
            return None
        return News(sender, changes[0], changes[1], placed, whole)


def _changes(told: dict[str, Counts], now: Mapping[str, Counts], nothing: Counts, whole: bool,
             only: Collection[str] | None) -> dict[str, Counts]:
    """What changed since ``told`` (updated to ``now``); a worker no longer held changes to ``nothing``."""
    workers = {*told, *now} if only is None else only
    changed: dict[str, Counts] = {}
    for worker_id in workers:
        value = now.get(worker_id, nothing)
        if whole or told.get(worker_id, nothing) != value:
            changed[worker_id] = value
        if any(value):
            told[worker_id] = value
        else:
            told.pop(worker_id, None)
    if whole:
        return {w: v for w, v in changed.items() if any(v)}
    return changed


OwnState = Callable[[Collection[str] | None], tuple[Mapping[str, Counts], Mapping[str, Counts]]]
"""(Workers, or None for all) → this process's (reservations (KV, prefill, unsettled requests), in-flight
(local, written)) there."""


def own_state(book: ReservationBook, inflight: InflightTracker) -> OwnState:
    """What this process tells its siblings, read from its reservation book and in-flight counts."""

    def state(workers: Collection[str] | None) -> tuple[Mapping[str, Counts], Mapping[str, Counts]]:
        return book.own_reservations(workers or None), inflight.own(workers)

    return state


class Siblings:
    """This process's side: sends its changes, takes the siblings' and hands them to whoever applies them
    (``on_placed`` for the KV index and the affinity map, ``on_change`` for the peer exchange and in-flight
    counts)."""

    def __init__(self, own_id: str, link: SiblingSocket, own_state: OwnState,
                 clock: Callable[[], float] = time.time) -> None:
        self.own_id = own_id
        self._link = link
        self._own_state = own_state
        self._clock = clock
        self.view = SiblingView()
        self._outbox = Outbox()
        self._placed: list[Placed] = []
        self._beat_at = float("-inf")
        self.on_placed: Callable[[Placed], None] = lambda placed: None
        self.on_change: Callable[[], None] = lambda: None

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(self.view.heard)

    def placed(self, worker_id: str, pending_keys: Sequence[int],
               affinity: Sequence[tuple[Hashable, str]]) -> None:
        """A placement here: goes out with the next ``send`` (right after the commit)."""
        self._placed.append(Placed(worker_id, pending_keys, affinity))

    def send(self, workers: Collection[str] | None = None) -> None:
        """Tell the siblings what changed here: on ``workers`` (a placement's, a release's), else anywhere,
        and everything when the beat is due."""
        now = self._clock()
        whole = workers is None and now - self._beat_at >= BEAT_S
        news = self._outbox.news(self.own_id, self._own_state(None if whole else workers), self._placed, whole,
                                 None if whole else workers)
        self._placed = []
        if whole:
            self._beat_at = now
        if news is not None:
            self._link.send(encode(news))

    def receive(self) -> None:
        """Take what the siblings sent (before a pick, and whenever the socket is readable)."""
        datagrams = self._link.receive()
        self.take([news for data in datagrams if (news := decode(data)) is not None])

    def take(self, batch: Sequence[News]) -> None:
        now = self._clock()
        changed = self.view.forget_silent(now)
        for news in batch:
            if news.sender == self.own_id:
                continue
            self.view.take(news, now)
            for placed in news.placed:
                self.on_placed(placed)
            changed = changed or bool(news.reservations or news.inflight or news.whole)
        if changed:
            self.on_change()

    def fileno(self) -> int:
        return self._link.fileno()

    def close(self) -> None:
        self._link.close()


def sibling_ports(spec: str | None) -> tuple[int, ...]:
    """``--siblings 5001,5002``: the gRPC ports of the extproc processes started together."""
    if not spec:
        return ()
    return tuple(int(p) for p in spec.split(",") if p.strip())

