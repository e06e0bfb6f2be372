"""Two controllers, the leader killed under load: the standby takes the lease, Envoy's ADS stream moves to it
and keeps its endpoints (no membership change, the very same resource versions), no request fails, no
worker is started, and the drain the old leader began is finished by the new one.

Its own stack (the fault suite's has one controller): Redis, two controllers (``--no-workers``: the
workers register straight into Redis, as a node agent would), one extproc, one Envoy whose xDS cluster
lists both controllers, three simulated workers, and OpenAI SDK clients sending chat requests throughout.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.procs import envoy_binary, free_port, port_open
from tests.faults.harness import (
    FAULT_CONFIG,
    MODEL,
    PREFIX,
    TOKEN,
    WORKER_IDS,
    BackgroundLoop,
    Heartbeats,
    Proc,
    envoy_endpoints,
    envoy_stat,
    wait_until,
    xds_versions,
)
from tests.run_dirs import run_directory

pytestmark = pytest.mark.e2e

LEASE_TTL_S = 2.0
HEARTBEAT_TTL_S = 3.0
"""Longer than the fault suite's 1 s: the SDK clients load this machine, and a worker whose heartbeat is late
leaves Envoy (a membership change that has nothing to do with the controllers)."""
CONFIG: dict[str, Any] = {
    **FAULT_CONFIG,
    "controller": {**FAULT_CONFIG["controller"], "heartbeat_interval_s": 0.5, "heartbeat_ttl_s": HEARTBEAT_TTL_S},
    "autoscale": {"lease_ttl_s": LEASE_TTL_S},
    "drain": {"settle_s": 10.0, "grace_s": 60.0},  # the drain outlives the leader that began it
}
CLIENTS = 6
DRAINED = "w3"


class TwoControllers:
    def __init__(self, run_dir: Path) -> None:
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(CONFIG))
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        redis_binary = shutil.which("redis-server")
        assert redis_binary, "redis-server is not installed"
        python = [sys.executable, "-m", "poolgate.cli"]
        common = ["--config", str(config_path), "--redis-url", self.redis_url]
        self.redis = Proc("redis", [redis_binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save",
                                    "", "--appendonly", "no", "--dir", str(run_dir)], run_dir / "redis.log")
        self.xds_ports = [free_port(), free_port()]
        self.api_ports = [free_port(), free_port()]
        self.controllers = [
            Proc(f"controller-{name}", [*python, "controller", *common, "--no-workers", "--xds-port", str(xds),
                                        "--http-port", str(api), "--log-dir", str(run_dir / f"workers-{name}")],
                 run_dir / f"controller-{name}.log")
            for name, xds, api in zip("ab", self.xds_ports, self.api_ports, strict=True)]
        self.extproc_port, metrics_port = free_port(), free_port()
        self.extproc = Proc("extproc", [*python, "extproc", *common, "--port", str(self.extproc_port),
                                        "--metrics-port", str(metrics_port)], run_dir / "extproc.log")
        self.envoy_port, self.admin_port = free_port(), free_port()
        bootstrap = render_bootstrap(parse_config(CONFIG), node_id="poolgate-ha", listen_port=self.envoy_port,
                                     admin_port=self.admin_port, extproc_port=self.extproc_port,
                                     xds_port=self.xds_ports)
        envoy_path = run_dir / "envoy.yaml"
        envoy_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        self.envoy = Proc("envoy", [str(envoy_binary()), "-c", str(envoy_path), "-l", "warning",
                                    "--use-dynamic-base-id", "--disable-hot-restart"], run_dir / "envoy.log")
        ports = {worker_id: free_port() for worker_id in WORKER_IDS}
        self.workers = [Proc(worker_id, [*python, "simworker", "--port", str(port), "--model", MODEL, "--worker-id",
                                         worker_id, "--time-scale", "4"], run_dir / f"{worker_id}.log")
                        for worker_id, port in ports.items()]
        self.heartbeats = Heartbeats(self.redis_url, {
            worker_id: WorkerRecord(id=worker_id, pool="chat", model=MODEL, host="127.0.0.1", port=port,
                                    backend="external") for worker_id, port in ports.items()},
            interval_s=0.5, ttl_s=HEARTBEAT_TTL_S)
        self.background = BackgroundLoop()
        self.load_loop = BackgroundLoop()
        """The clients run apart from the heartbeats, so a busy client never delays a heartbeat."""
        self._stop_heartbeats = asyncio.Event()
        self.keys = RedisKeys(PREFIX)

    @property
    def procs(self) -> list[Proc]:
        return [self.redis, *self.workers, *self.controllers, self.extproc, self.envoy]

    def start(self) -> None:
        self.redis.start()
        wait_until(lambda: port_open("127.0.0.1", self.redis_port), 15, "redis listening")
        self.redis_client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        for worker in self.workers:
            worker.start()
        asyncio.run_coroutine_threadsafe(self.heartbeats.run(self._stop_heartbeats), self.background.loop)
        first, second = self.controllers
        first.start()
        wait_until(lambda: self.leader_pid() == first.pid, 30, "the first controller leads")
        second.start()
        self.extproc.start()
        for port in (*self.xds_ports, self.extproc_port):
            wait_until(lambda port=port: port_open("127.0.0.1", port), 30, f"port {port} listening")
        self.envoy.start()
        wait_until(lambda: port_open("127.0.0.1", self.admin_port), 60, "Envoy's admin listening")
        wait_until(lambda: len(self.endpoints()) == len(WORKER_IDS), 60, "every worker in Envoy")

    def leader_pid(self) -> int | None:
        """The pid in the lease holder's id (``host-pid-random``), or None when nobody holds it."""
        holder = self.redis_client.get(self.keys.leader)
        if not holder:
            return None
        prefix = f"{socket.gethostname()}-"
        return int(str(holder)[len(prefix):].split("-")[0]) if str(holder).startswith(prefix) else None

    def stat(self, name: str) -> str:
        return envoy_stat(self.admin_port, name)

    def endpoints(self) -> dict[str, str]:
        return envoy_endpoints(self.admin_port)

    def xds_version(self) -> tuple[str, str]:
        return xds_versions(self.admin_port)

    def stop(self) -> None:
        self.background.loop.call_soon_threadsafe(self._stop_heartbeats.set)
        time.sleep(0.3)
        for proc in reversed(self.procs):
            if proc.alive():
                proc.kill(signal.SIGTERM)
            proc.kill(signal.SIGKILL)
        self.background.close()
        self.load_loop.close()


@pytest.fixture()
def two_controllers() -> Iterator[TwoControllers]:
    stack = TwoControllers(run_directory("poolgate-ha-"))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


async def _clients(port: int, stop: asyncio.Event, outcomes: list[str]) -> None:
    """``CLIENTS`` OpenAI SDK clients, each sending one chat request after another until ``stop``."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                timeout=15)

    async def one_client() -> None:
        while not stop.is_set():
            try:
                reply = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4)
                outcomes.append("ok" if reply.choices else "empty")
            except openai.OpenAIError as exc:
                outcomes.append(f"{type(exc).__name__}: {str(exc)[:80]}")

    try:
        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
    finally:
        await client.close()


def test_standby_takes_over_when_the_leader_is_killed_under_load(two_controllers: TwoControllers) -> None:
    stack = two_controllers
    leader, standby = stack.controllers
    drain = httpx.post(f"http://127.0.0.1:{stack.api_ports[0]}/v1/workers/{DRAINED}/drain",
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert drain.status_code == 202, drain.text
    wait_until(lambda: "draining" in stack.endpoints().get(_host_of(stack, DRAINED), ""), 10, "w3 Draining in Envoy")
    assert set(stack.redis_client.hkeys(stack.keys.drains)) == {DRAINED}
    hosts_before, versions_before = stack.endpoints(), stack.xds_version()
    membership_before = int(stack.stat("cluster.pool-chat.membership_change") or 0)
    stop = asyncio.Event()
    outcomes: list[str] = []
    load = asyncio.run_coroutine_threadsafe(_clients(stack.envoy_port, stop, outcomes), stack.load_loop.loop)
    try:
        wait_until(lambda: len(outcomes) >= 20, 30, "load running")
        killed_at = time.monotonic()
        leader.kill(signal.SIGKILL)
        wait_until(lambda: stack.leader_pid() == standby.pid, 10 * LEASE_TTL_S, "the standby leads")
        takeover_s = time.monotonic() - killed_at
        wait_until(lambda: stack.stat("control_plane.connected_state") == "1", 30, "Envoy's ADS on the standby")
        wait_until(lambda: not stack.redis_client.hkeys(stack.keys.drains), 30, "the standby finished the drain")
        time.sleep(1.0)  # anything the standby would push has arrived
        sent_after = len(outcomes)
        wait_until(lambda: len(outcomes) >= sent_after + 20, 30, "load still served")
    finally:
        stack.load_loop.loop.call_soon_threadsafe(stop.set)
        load.result(30)
    flaps = int(stack.stat("cluster.pool-chat.membership_change") or 0) - membership_before
    failed = [o for o in outcomes if o != "ok"]
    standby_log = standby.log_text()
    print(f"\nHA controller failover: takeover {takeover_s:.2f} s (lease TTL {LEASE_TTL_S:g} s), requests "
          f"{len(outcomes)}, failed {len(failed)}, endpoint membership changes {flaps}", flush=True)
    assert takeover_s <= 3 * LEASE_TTL_S, "the standby must lead within about one lease TTL"
    assert flaps == 0 and stack.endpoints() == hosts_before
    assert stack.xds_version() == versions_before, "the standby serves other resources than the leader did"
    assert not failed, failed[:5]
    assert f"worker {DRAINED}: resuming a drain" in standby_log and f"worker {DRAINED}: drain over" in standby_log
    assert "started worker" not in standby_log and "started worker" not in leader.log_text()
    registered = sorted(stack.redis_client.smembers(stack.keys.workers))
    assert registered == sorted(WORKER_IDS)


def _host_of(stack: TwoControllers, worker_id: str) -> str:
    record = stack.heartbeats.records[worker_id]
    return f"{record.host}:{record.port}"
