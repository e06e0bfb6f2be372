"""Local process backend: starts the configured workers on this machine and keeps them registered.

A worker is a ``poolgate simworker`` process (backend ``sim``) or a real ``vllm serve`` process (backend
``vllm``, with ``CUDA_VISIBLE_DEVICES`` from the spec). Each worker gets a supervisor task that:

1. waits for ``/health`` to answer 200 (connection refused = still loading; vLLM opens its port only when
   the engine is ready), then registers the worker in Redis;
2. probes ``/health`` every heartbeat interval and refreshes the registration (Ready, or Failed after
   ``failures_to_fail`` consecutive failed probes);
3. deregisters at once when the process exits, and restarts it with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from poolgate.config import Config, WorkerSpec
from poolgate.fleet import (
    FleetKeys,
    RedisLike,
    WorkerRecord,
    WorkerState,
    deregister_worker,
    heartbeat_worker,
    register_worker,
)
from poolgate.procs import free_port

log = logging.getLogger("poolgate.controller.local")


def worker_command(config: Config, spec: WorkerSpec, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start one worker."""
    pool = config.pool(spec.pool)
    env: dict[str, str] = {}
    if spec.backend == "sim":
        cmd = [sys.executable, "-m", "poolgate.cli", "simworker", "--host", spec.host, "--port", str(port),
               "--model", pool.model, "--worker-id", spec.id, "--preset", spec.preset,
               "--max-model-len", str(pool.max_model_len)]
    else:
        assert spec.model_path is not None  # the config validator guarantees it
        cmd = ["vllm", "serve", spec.model_path, "--host", spec.host, "--port", str(port),
               "--served-model-name", pool.model, "--max-model-len", str(pool.max_model_len),
               "--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        if spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return [*cmd, *spec.extra_args], env


@dataclass
class WorkerProcess:
    spec: WorkerSpec
    port: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    registered: bool = False
    consecutive_failures: int = 0
    state: WorkerState = WorkerState.STARTING
    stopping: bool = False
    log_path: Path | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class LocalProcessBackend:
    """Starts, supervises and stops the config's workers as child processes of the controller."""

    def __init__(self, config: Config, redis: RedisLike, keys: FleetKeys, log_dir: Path,
                 failures_to_fail: int = 3, max_backoff_s: float = 30.0) -> None:
        self._config = config
        self._redis = redis
        self._keys = keys
        self._log_dir = log_dir
        self._failures_to_fail = failures_to_fail
        self._max_backoff_s = max_backoff_s
        self._workers: dict[str, WorkerProcess] = {}
        self._http: aiohttp.ClientSession | None = None

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        return self._workers

    async def start_all(self) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        for spec in self._config.workers:
            worker = WorkerProcess(spec=spec, port=spec.port or free_port(spec.host),
                                   log_path=self._log_dir / f"{spec.id}.log")
            self._workers[spec.id] = worker
            worker.task = asyncio.create_task(self._supervise(worker), name=f"worker-{spec.id}")

    async def stop_all(self, grace_s: float = 5.0) -> None:
        for worker in self._workers.values():
            worker.stopping = True
            if worker.task:
                worker.task.cancel()
        await asyncio.gather(*(w.task for w in self._workers.values() if w.task), return_exceptions=True)
        await asyncio.gather(*(self._terminate(w, grace_s) for w in self._workers.values()))
        for worker in self._workers.values():
            if worker.registered:
                with contextlib.suppress(Exception):
                    await deregister_worker(self._redis, self._keys, worker.spec.id)
        if self._http:
            await self._http.close()

    async def _spawn(self, worker: WorkerProcess) -> None:
        cmd, extra_env = worker_command(self._config, worker.spec, worker.port)
        assert worker.log_path is not None
        log_file = worker.log_path.open("ab")
        try:
            worker.process = await asyncio.create_subprocess_exec(
                *cmd, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **extra_env},
            )
        finally:
            log_file.close()
        log.info("started worker %s (pid %s) on %s:%s, log %s", worker.spec.id, worker.process.pid,
                 worker.spec.host, worker.port, worker.log_path)

    async def _terminate(self, worker: WorkerProcess, grace_s: float) -> None:
        process = worker.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def _probe(self, worker: WorkerProcess) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(f"http://{worker.spec.host}:{worker.port}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _record(self, worker: WorkerProcess) -> WorkerRecord:
        pool = self._config.pool(worker.spec.pool)
        return WorkerRecord(id=worker.spec.id, pool=pool.name, model=pool.model, host=worker.spec.host,
                            port=worker.port, max_model_len=pool.max_model_len, backend=worker.spec.backend,
                            state=WorkerState.READY)

    async def _supervise(self, worker: WorkerProcess) -> None:
        settings = self._config.controller
        backoff = 1.0
        while not worker.stopping:
            await self._spawn(worker)
            assert worker.process is not None
            started = time.monotonic()
            exit_wait = asyncio.create_task(worker.process.wait())
            try:
                while not exit_wait.done():
                    await self._tick(worker)
                    await asyncio.wait({exit_wait}, timeout=settings.heartbeat_interval_s)
            finally:
                if not exit_wait.done():
                    exit_wait.cancel()
            if worker.registered:
                await deregister_worker(self._redis, self._keys, worker.spec.id)
                worker.registered = False
            log.warning("worker %s exited with code %s; restarting in %.0f s", worker.spec.id,
                        worker.process.returncode, backoff)
            worker.restarts += 1
            if time.monotonic() - started > 60:
                backoff = 1.0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _tick(self, worker: WorkerProcess) -> None:
        """One health probe and the registry update that follows from it."""
        ttl = self._config.controller.heartbeat_ttl_s
        healthy = await self._probe(worker)
        if not worker.registered:
            if healthy:
                await register_worker(self._redis, self._keys, self._record(worker), ttl)
                worker.registered = True
                worker.consecutive_failures = 0
                worker.state = WorkerState.READY
                log.info("worker %s is ready at %s:%s", worker.spec.id, worker.spec.host, worker.port)
            return
        worker.consecutive_failures = 0 if healthy else worker.consecutive_failures + 1
        # Tolerate a few missed probes before ejecting; one good probe brings the worker back.
        state = WorkerState.FAILED if worker.consecutive_failures >= self._failures_to_fail else WorkerState.READY
        changed = state != worker.state
        worker.state = state
        alive = await heartbeat_worker(self._redis, self._keys, worker.spec.id, ttl, state=state, announce=changed)
        if not alive:  # the registration expired (Redis restarted, long pause): register again
            await register_worker(self._redis, self._keys, self._record(worker).with_live(state=state), ttl)
