"""One worker's event stream in order: sequence numbers, gaps, restarts, replays (pure; no sockets).

The publisher numbers its batches 0, 1, 2, …; the stream's view is exact while every batch arrives in
order. What can go wrong, and what the stream does:

- joined mid-stream (first batch seen has sequence > 0, as for a replica that starts after the worker):
  replay from 0; if the publisher's replay buffer still starts at 0 the view is complete;
- a gap (sequence > last + 1: ZMQ dropped at its high-water mark, or the connection broke): unknown until
  the replay of the missing batches has been applied;
- a restart (sequence <= last: a new engine, whose cache starts empty): forget everything the worker
  held, then as a join;
- history that cannot be replayed (no replay socket, the buffer moved on, a reply that timed out, a batch
  that does not decode): forget, apply what did arrive, and stay unknown for ``relearn_s``, after which
  the blocks stored since then are most of what the worker caches (vLLM evicts the least recently used).

Unknown is never empty: the scheduler falls back to its estimate for an unknown worker.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.wire import Frame, KVEventDecodeError, decode_batch

log = logging.getLogger(__name__)

RECENT_BATCHES = 256
"""Batches remembered by sequence and payload, to tell a replayed batch seen live from a restart."""


class WorkerStream:
    def __init__(self, worker_id: str, index: PrefixIndex, clock: Callable[[], float], relearn_s: float = 30.0) -> None:
        self.worker_id = worker_id
        self._index = index
        self._clock = clock
        self._relearn_s = relearn_s
        self.last: int | None = None
        self._relearn_until = 0.0
        self.gaps = 0
        self.lost = 0
        """Times history could not be replayed (the view was rebuilt from what arrived)."""
        self._recent: OrderedDict[int, int] = OrderedDict()

    def already_applied(self, frame: Frame) -> bool:
        """The same batch again (a replay overlapping live delivery): skip it. A different batch under an
        old sequence number is a restarted publisher."""
        return self._recent.get(frame.sequence) == hash(frame.payload)

    def replay_from(self, sequence: int) -> int | None:
        """The sequence to replay from before ``sequence`` can be applied, or None if it follows on. A
        restart forgets the worker's blocks here."""
        last = self.last
        if last is not None and sequence <= last:
            log.info("worker %s: KV event stream restarted (%d after %d); its cache starts empty",
                     self.worker_id, sequence, last)
            self.restarted()
            last = None
        if last is None:
            return 0 if sequence > 0 else None
        if sequence == last + 1:
            return None
        self.gaps += 1
        self._index.mark_unknown(self.worker_id)
        return last + 1

    def restarted(self) -> None:
        """A new publisher (its numbers start again at 0): forget what the worker held before."""
        self._index.reset(self.worker_id)
        self._recent.clear()
        self.last = None

    def catch_up(self, start: int, before: int, replayed: Sequence[Frame]) -> None:
        """Apply the replayed batches ``start`` … ``before - 1``; a hole in them means history is lost."""
        wanted = sorted((f for f in replayed if start <= f.sequence < before), key=lambda f: f.sequence)
        complete = [f.sequence for f in wanted] == list(range(start, before))
        if not complete:
            self._lose_history(f"replay of {start}..{before - 1} incomplete")
        for frame in wanted:
            self._apply(frame)

    def accept(self, frame: Frame) -> None:
        """A batch that follows on (after ``catch_up`` where ``replay_from`` asked for it)."""
        self._apply(frame)
        self._known_unless_relearning()

    def disconnected(self) -> None:
        self._index.mark_unknown(self.worker_id)

    def idle_in_sync(self) -> None:
        """The replay showed nothing is missing: the same publisher still ends at the last batch applied, or
        one that has published nothing yet (its engine stored nothing: an empty cache, known)."""
        self._known_unless_relearning()

    def _known_unless_relearning(self) -> None:
        if self._clock() < self._relearn_until or self._index.is_known(self.worker_id):
            return
        self._index.mark_known(self.worker_id)
        log.info("worker %s: KV events in sync at batch %s; picks use its exact cached prefixes", self.worker_id,
                 "none yet" if self.last is None else self.last)

    def _apply(self, frame: Frame) -> None:
        try:
            batch = decode_batch(frame.payload)
        except KVEventDecodeError as error:
            self._lose_history(f"batch {frame.sequence} does not decode: {error}")
        else:
            self._index.apply(self.worker_id, batch)
        self.last = frame.sequence
        self._recent[frame.sequence] = hash(frame.payload)
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)

    def _lose_history(self, why: str) -> None:
        log.warning("worker %s: KV event history lost (%s); relearning for %.0f s", self.worker_id, why,
                    self._relearn_s)
        self.lost += 1
        self._index.reset(self.worker_id)
        self._index.mark_unknown(self.worker_id)
        self._relearn_until = self._clock() + self._relearn_s
