"""Real Redis deployments for tests and benchmarks, started from the Debian package's binaries on free
ports: one server, a Sentinel group (a master, two replicas, three sentinels) and a Redis Cluster (three
masters, three replicas). Timeouts are tuned low (1 s to notice a dead master) so a failover takes seconds;
every process and directory is removed by ``stop``."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from poolgate.kernel.errors import PoolgateError
from poolgate.procs import free_port, stop_process

DOWN_AFTER_MS = 1000
"""Sentinel's ``down-after-milliseconds`` and Cluster's ``cluster-node-timeout``."""
START_TIMEOUT_S = 60.0
"""Generous: the shared test machine can be heavily loaded."""


def binaries_missing() -> str | None:
    """Why these deployments cannot start here, or None."""
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian packages redis-server and redis-tools)"
    return None


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


class _Processes:
    def __init__(self, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"poolgate-{name}-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *args: str) -> None:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)  # a node started again keeps its directory
        self.procs[port] = subprocess.Popen(
            [str(shutil.which("redis-server")), *args, "--port", str(port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(node_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self, port: int) -> None:
        """SIGKILL: a crash, no goodbye to replicas or sentinels."""
        self.procs[port].kill()
        self.procs[port].wait()

    def alive(self, port: int) -> bool:
        return self.procs[port].poll() is None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop_process(proc, grace_s=2.0)
        shutil.rmtree(self.dir, ignore_errors=True)


def _low_free_port() -> int:
    """A free port a cluster node accepts (Redis refuses ports above 55535 even with its bus port set)."""
    while (port := free_port()) > 55535:
        pass
    return port


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)


def _ask(port: int, *command: str) -> Any:
    client = _client(port)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


PORT_ATTEMPTS = 5
"""Free ports a test Redis is tried on before giving up (another process may take one first)."""


class PortTaken(PoolgateError, RuntimeError):
    """The redis-server exited at once: its port was taken between picking it and binding it."""


class RedisServer:
    """A redis-server of the tests' own; ``durable``: every write in an append-only file synced at once, so
    one that is killed and started again (``kill``, ``start``) comes back with its data."""

    def __init__(self, durable: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.dir = tempfile.mkdtemp(prefix="poolgate-redis-")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self.command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
                            "--dir", self.dir]
            self.url = f"redis://127.0.0.1:{self.port}/0"
            try:
                self.start()
                return
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise

    def start(self) -> None:
        """Start it (again, on the same port and directory) and wait until it answers. The answer must come
        from this process: when another server took the port first, ours exits, and the tests would otherwise
        share that other server (another test run's, emptied by its own tests)."""
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        try:
            while True:
                if self.proc.poll() is not None:
                    raise PortTaken(f"redis-server exited at once with {self.proc.returncode} (port {self.port})")
                try:
                    if client.info("server")["process_id"] == self.proc.pid:
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown."""
        self.proc.kill()
        self.proc.wait()

    def flush(self) -> None:
        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A master with two replicas watched by three sentinels (quorum 2) as service ``SERVICE``."""

    SERVICE = "poolgate-test"

    def __init__(self) -> None:
        self._procs = _Processes("sentinel")
        try:
            self.master_port = free_port()
            self.replica_ports = [free_port() for _ in range(2)]
            self.sentinel_ports = [free_port() for _ in range(3)]
            self._procs.start(self.master_port)
            for port in self.replica_ports:
                self._procs.start(port, "--replicaof", "127.0.0.1", str(self.master_port))
            for port in self.sentinel_ports:
                config = self._procs.dir / f"sentinel-{port}.conf"
                config.write_text(
                    f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master_port} 2\n"
                    f"sentinel down-after-milliseconds {self.SERVICE} {DOWN_AFTER_MS}\n"
                    f"sentinel failover-timeout {self.SERVICE} 5000\n"
                    f"sentinel parallel-syncs {self.SERVICE} 2\n")
                self._procs.start(port, str(config), "--sentinel")
            _wait("the replicas to sync", lambda: all(
                _ask(p, "INFO", "replication").get("master_link_status") == "up" for p in self.replica_ports))
            _wait("the sentinels to find each other and the replicas", lambda: all(
                len(_ask(p, "SENTINEL", "SENTINELS", self.SERVICE)) == 2
                and len(_ask(p, "SENTINEL", "REPLICAS", self.SERVICE)) == 2 for p in self.sentinel_ports))
        except BaseException:
            self._procs.stop()
            raise
        self.url = f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.sentinel_ports)}/{self.SERVICE}/0"

    def current_master(self) -> int:
        """The master's port as the sentinels name it now."""
        _host, port = _ask(self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        return int(port)

    def fail_master(self) -> int:
        """Kill the current master; returns its port."""
        port = self.current_master()
        self._procs.kill(port)
        return port

    def restart(self, port: int) -> None:
        """Start a killed data node again, as a replica of the master the sentinels name now (what Sentinel's
        rewrite of a returning master's configuration makes of it)."""
        master = self.current_master()
        self._procs.start(port, *(("--replicaof", "127.0.0.1", str(master)) if master != port else ()))

    def pids(self) -> dict[str, int]:
        """``redis-PORT`` (master or replica) and ``sentinel-PORT`` → pid, for the live processes."""
        names = {port: f"redis-{port}" for port in (self.master_port, *self.replica_ports)}
        names |= {port: f"sentinel-{port}" for port in self.sentinel_ports}
        return {name: self._procs.procs[port].pid for port, name in names.items() if self._procs.alive(port)}

    def stop(self) -> None:
        self._procs.stop()


class ClusterDeployment:
    """Three masters with one replica each (``redis-cli --cluster create … --cluster-replicas 1``)."""

    def __init__(self) -> None:
        self._procs = _Processes("cluster")
        try:
            self.ports = [_low_free_port() for _ in range(6)]
            for port in self.ports:
                self._procs.start(port, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                  "--cluster-port", str(free_port()),
                                  "--cluster-node-timeout", str(DOWN_AFTER_MS),
                                  "--cluster-replica-validity-factor", "0",
                                  "--cluster-require-full-coverage", "no")
            for port in self.ports:
                _wait(f"node {port}", functools.partial(_ask, port, "PING"))
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"], check=True, timeout=START_TIMEOUT_S,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait("the cluster to be ok on every node", lambda: all(
                b"cluster_state:ok" in _ask(p, "CLUSTER", "INFO") for p in self.ports))
            _wait("every master to have its replica", lambda: self._replicas_in_sync())
        except BaseException:
            self._procs.stop()
            raise
        self.url = f"redis+cluster://{','.join(f'127.0.0.1:{p}' for p in self.ports[:2])}"

    def _replicas_in_sync(self) -> bool:
        infos = [_ask(p, "INFO", "replication") for p in self.ports]
        replicas = [info for info in infos if info.get("role") == "slave"]
        return len(replicas) == 3 and all(info.get("master_link_status") == "up" for info in replicas)

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now (asked of a live node)."""
        slot = key_slot(key.encode())
        for port in self.ports:
            if self._procs.procs[port].poll() is not None:
                continue
            try:
                ranges = _ask(port, "CLUSTER", "SLOTS")
            except (redis.RedisError, OSError):
                continue
            for start, end, master, *_ in ranges:
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise RuntimeError(f"no live node serves slot {slot}")

    def fail_master_of(self, key: str) -> int:
        """Kill the master serving ``key``; returns its port."""
        port = self.master_of(key)
        self._procs.kill(port)
        return port

    def stop(self) -> None:
        self._procs.stop()
