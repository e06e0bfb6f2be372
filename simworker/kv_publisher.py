"""vLLM's ZMQ KV-event publisher for the simulated worker: ``--kv-events-config`` as vLLM takes it.

Frames on the PUB socket: ``(topic, sequence as 8 bytes big-endian, msgpack payload)``, one message per
engine step that changed the cache, the sequence counting from 0. The ROUTER replay socket answers a
request ``(identity, b"", start sequence as 8 bytes)`` with every buffered message from that sequence on,
each as ``(identity, b"", sequence, payload)``, then ``(identity, b"", -1 as 8 signed bytes, b"")``.
The last ``buffer_steps`` messages are kept for replay. A PUB endpoint with ``*``, ``::``, ``ipc://`` or
``inproc://`` is bound, any other is connected to (vLLM's rule); the replay endpoint is always bound.

Several workers in one process (``--ports``) each publish on the configured ports plus their index, as
vLLM offsets the ports of its data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Literal

import zmq
import zmq.asyncio

from simworker.json_flag import json_object
from simworker.kv_events import KVEvent, encode_batch

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """Default: ``zmq`` when events are enabled, else ``null``."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; ValueError names the field that is wrong."""
        raw = json_object("--kv-events-config", text)
        known = {f.name: f for f in fields(cls)}
        for name, value in raw.items():
            if name not in known:
                raise ValueError(f"--kv-events-config: unknown field {name!r} (known: {', '.join(known)})")
            _check_field(name, value)
        return cls(**raw)

    def offset(self, index: int) -> KVEventsConfig:
        """The config of the ``index``-th worker of a process: tcp ports moved up by ``index``."""
        if index == 0:
            return self
        return replace(self, endpoint=_offset_port(self.endpoint, index),
                       replay_endpoint=_offset_port(self.replay_endpoint, index) if self.replay_endpoint else None)


def _check_field(name: str, value: object) -> None:
    expected: dict[str, type | tuple[type, ...]] = {
        "enable_kv_cache_events": bool, "publisher": (str, type(None)), "endpoint": str,
        "replay_endpoint": (str, type(None)), "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str,
    }
    if not isinstance(value, expected[name]) or (expected[name] is int and isinstance(value, bool)):
        raise ValueError(f"--kv-events-config: {name} has the wrong type ({type(value).__name__})")
    if name == "publisher" and value not in (None, "null", "zmq"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {value!r}")
    if name in ("buffer_steps", "hwm", "max_queue_size") and isinstance(value, int) and value < 1:
        raise ValueError(f"--kv-events-config: {name} must be at least 1")


def _offset_port(endpoint: str, index: int) -> str:
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_{index}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot offset the port of {endpoint!r} for worker {index}")
    return f"{base}:{int(port) + index}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """Sends each step's events at once (a PUB socket never blocks: past its high-water mark ZMQ drops,
    and a subscriber sees the gap in the sequence) and serves replays from the buffer."""

    def __init__(self, config: KVEventsConfig, context: zmq.asyncio.Context, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._sequence = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        sync_context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        self._pub: zmq.Socket[bytes] = sync_context.socket(zmq.PUB)  # sync: sends at once, never blocks
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(config.endpoint):
            _bind(self._pub, config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, config.replay_endpoint)

    @property
    def next_sequence(self) -> int:
        return self._sequence

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, self._rank)
        sequence = self._sequence
        self._sequence += 1
        self._buffer.append((sequence, payload))
        try:
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:  # a subscriber notices the gap and replays
            log.warning("KV events batch %d not sent: %s", sequence, error)

    async def serve_replays(self) -> None:
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV events replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            start_sequence = int.from_bytes(start, "big")
            for sequence, payload in list(self._buffer):
                if sequence >= start_sequence:
                    await self._replay.send_multipart((identity, b"", sequence.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self.config.endpoint.startswith("ipc://"):  # a bound ipc socket leaves its file behind
            with contextlib.suppress(OSError):
                os.unlink(self.config.endpoint.removeprefix("ipc://"))


BIND_RETRY_S = 2.0
"""How long a bind waits for its address: ZMQ closes sockets in its I/O thread after ``close`` returns, so a
worker restarted in the same process can find its own old socket still bound for a moment."""


def _bind(socket: zmq.Socket[bytes] | zmq.asyncio.Socket, endpoint: str) -> None:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)  # start-up only, never on a step
