"""Workers the controller starts on free ports: one whose port was taken before it could bind it (another
process bound it first: the race every "free port" has) starts again on a new port and serves, instead of
failing on the taken port for ever. A real simulated worker process, a real Redis."""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from controller import local_backend
from controller.local_backend import LocalProcessBackend, worker_command
from poolgate.kernel.config import Config
from poolgate.kernel.net import free_port
from poolgate.kernel.store import FleetStore

PREFIX = "ports-it"


async def test_a_worker_whose_free_port_was_taken_starts_on_another(
        redis_client: aioredis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config.model_validate({"key_prefix": PREFIX, "pools": [{"name": "chat", "model": "m"}],
                                    "workers": [{"id": "w1", "pool": "chat"}]})
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    monkeypatch.setattr(local_backend, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
    store = FleetStore(redis_client, PREFIX)
    backend = LocalProcessBackend(store, tmp_path, functools.partial(worker_command, config), pools=config.pools,
                                  workers=config.workers, settings=config.controller, placement=config.placement,
                                  scaling={})
    started = time.monotonic()
    try:
        await backend.start_all()
        record = None
        while record is None and time.monotonic() - started < 60:
            record = next(iter(await store.read_fleet()), None)
            await asyncio.sleep(0.1)
        assert record is not None, (tmp_path / "w1.log").read_text()
        print(f"\nmeasured: registered on port {record.port} {time.monotonic() - started:.1f} s after the start "
              f"(first port {taken_port} taken; {backend.workers['w1'].restarts} restart)")
        assert record.port != taken_port
        assert backend.workers["w1"].restarts >= 1
        assert "address already in use" in (tmp_path / "w1.log").read_text().lower()
    finally:
        await backend.stop_all()
        taken.close()
