"""Launched workers publish their KV-cache events: the ``--kv-events-config`` flag and the record's endpoints.

vLLM binds its PUB socket only for ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints (any other it
connects to), and always binds the replay socket. A worker on this machine publishes on an ``ipc://`` socket
in the temporary directory and replays on loopback TCP, so prompts' token ids never leave the machine. A flag the
worker's ``extra_args`` already carry wins: its endpoints go into the record as subscribers reach them (the
config refuses at load an endpoint vLLM would connect to: ``poolgate.kernel.config.worker_launch``).
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

from poolgate.kernel.config.worker_launch import KV_EVENTS_FLAG, kv_events_config

FLAG = KV_EVENTS_FLAG
TOPIC = "kv-events"


@dataclass(frozen=True, slots=True)
class KvEventsLaunch:
    args: tuple[str, ...]
    """Flags to add to the worker's command line (empty when ``extra_args`` set them)."""
    endpoint: str
    replay_endpoint: str

    def remove_socket(self) -> None:
        """Remove the Unix socket this launch chose for the worker, once its process has ended: an engine that is
        killed (or whose publisher does not close) leaves the file behind in the temporary directory."""
        if self.args and self.endpoint.startswith("ipc://"):
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def kv_events_launch(extra_args: tuple[str, ...], host: str, socket_path: Path, replay_port: int) -> KvEventsLaunch:
    given = _given_config(extra_args)
    if given is not None:
        return KvEventsLaunch((), _reachable(str(given.get("endpoint", "tcp://*:5557")), host),
                              _reachable(str(given.get("replay_endpoint") or ""), host))
    endpoint = f"ipc://{socket_path}"
    replay = f"tcp://{host}:{replay_port}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
              "topic": TOPIC}
    return KvEventsLaunch((FLAG, orjson.dumps(config).decode()), endpoint, replay)


def kv_socket_path(log_dir: Path, worker_id: str) -> Path:
    """A short path in the temporary directory (a Unix socket's path is limited to ~100 bytes), unique per
    log directory and worker."""
    digest = hashlib.blake2b(f"{log_dir.resolve()}/{worker_id}".encode(), digest_size=8).hexdigest()
    return Path(tempfile.gettempdir()) / f"poolgate-kv-{digest}.sock"


def _given_config(extra_args: tuple[str, ...]) -> dict[str, object] | None:
    given, config = kv_events_config(extra_args)
    if not given:
        return None
    return config if config is not None and config.get("enable_kv_cache_events") else {}


def _reachable(endpoint: str, host: str) -> str:
    """A bound wildcard (``tcp://*:P``, ``tcp://[::]:P``) as a subscriber connects to it."""
    if endpoint.startswith(("tcp://*:", "tcp://[::]:", "tcp://0.0.0.0:")):
        return f"tcp://{host}:{endpoint.rpartition(':')[2]}"
    return endpoint
