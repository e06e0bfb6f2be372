"""Local process backend: starts workers on this machine as child processes and keeps them registered.

A worker is a ``poolgate simworker`` process (backend ``sim``) or a real ``vllm serve`` process (backend
``vllm``, with ``CUDA_VISIBLE_DEVICES`` from its spec or from GPU-aware placement, or on CPU with
``VLLM_CPU_KVCACHE_SPACE`` from its ``kv_cache_gib``). Each worker gets a
supervisor task that:

1. waits for ``/health`` to answer 200 (connection refused = still loading; vLLM opens its port only when
   the engine is ready), then registers the worker in Redis as Ready;
2. refreshes the registration every heartbeat interval while the process lives (liveness only: the health
   monitor owns Ready/Busy/Failed, the drainer owns Draining);
3. deregisters at once when the process exits, and restarts it with exponential backoff (at once when
   the controller asked for the restart).

Workers come from the config, or are added at run time from a pool's template (``launch``). With
``tls.local_workers`` they serve HTTPS from those certificate files (vLLM's ``--ssl-*`` flags), and the
health check before registration speaks TLS as ``tls.workers`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from controller.backend import PlacementRefused
from controller.kv_events_launch import KvEventsLaunch, kv_events_launch, kv_socket_path
from controller.placement import GpuFree, Placement, place
from poolgate.kernel.child_process import own_group_dying_with_parent
from poolgate.kernel.config import (
    Config,
    ControllerSettings,
    LoraAdapter,
    PlacementSettings,
    PoolScaling,
    PoolSpec,
    TlsServerFiles,
    WorkerSpec,
    has_flag,
)
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.net import free_port
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.local")

LOADING_PROBE_S = 0.1
"""A worker not yet registered is probed this often (at most: the heartbeat interval when shorter): its port
opens once the model is loaded, and the first request to a pool at zero waits for that moment, not for the next
heartbeat as well. A refused connection costs nothing."""
WORKER_KEY_ENV = "VLLM_API_KEY"
"""Where vLLM (and the simulated worker) read the key that ``--api-key`` would give."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""Without it vLLM serves no ``/v1/load_lora_adapter``, and the controller cannot load adapters."""


def lora_launch(adapters: Sequence[LoraAdapter], served_name: str,
                extra_args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment that let the controller load the catalogue's adapters for this base model at
    run time: ``--enable-lora``, room for all of them at once, and the run-time loading switch. What
    ``extra_args`` already sets wins; the rank limit (``--max-lora-rank``, 16 by default) is left to it."""
    adapters = [a for a in adapters if a.base == served_name and a.path]
    if not adapters:
        return [], {}
    args = [] if has_flag(extra_args, "--enable-lora") else ["--enable-lora"]
    if not has_flag(extra_args, "--max-loras"):
        args += ["--max-loras", str(len(adapters))]
    return args, {RUNTIME_LORA_ENV: "True"}


POOL_TASK_ARGS = {"embed": ("--runner", "pooling", "--convert", "embed"),
                  "score": ("--runner", "pooling", "--convert", "classify")}
"""vLLM's flags for a pool's model kind (``--task`` is gone since 0.10); speech-to-text models vLLM recognises
by their architecture, the simulated worker by ``--transcription``."""


def task_launch(task: str, backend: str, extra_args: tuple[str, ...]) -> list[str]:
    """Flags that start a worker as its pool's kind of model, unless ``extra_args`` chooses one itself."""
    if any(has_flag(extra_args, flag) for flag in ("--runner", "--convert", "--task", "--transcription")):
        return []
    if task == "transcription":
        return ["--transcription"] if backend == "sim" else []
    return list(POOL_TASK_ARGS.get(task, ()))


KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def role_launch(role: str, extra_args: tuple[str, ...]) -> list[str]:
    """``--kv-transfer-config`` for a prefill or decode pool's worker (vLLM's NixlConnector; the simulator
    takes the same flag), unless ``extra_args`` sets one itself (another connector, a link speed)."""
    if role not in KV_ROLES or has_flag(extra_args, "--kv-transfer-config"):
        return []
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role]})]


def tls_launch(files: TlsServerFiles | None, backend: str, extra_args: tuple[str, ...]) -> list[str]:
    """vLLM's HTTPS flags for a worker from ``tls.local_workers`` (the simulated worker takes the same ones),
    unless ``extra_args`` gives its own certificate. vLLM re-reads rotated files only with
    ``--enable-ssl-refresh`` and asks for client certificates only with ``--ssl-cert-reqs 2``
    (``ssl.CERT_REQUIRED``); the simulated worker always re-reads its files and requires a client
    certificate whenever it has ``--ssl-ca-certs``."""
    if files is None or has_flag(extra_args, "--ssl-certfile"):
        return []
    args = ["--ssl-certfile", files.cert_file, "--ssl-keyfile", files.key_file]
    if backend == "vllm":
        args.append("--enable-ssl-refresh")
    if files.client_ca_file is not None:
        args += ["--ssl-ca-certs", files.client_ca_file]
        if backend == "vllm":
            args += ["--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))]
    return args


CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""GiB of KV cache for vLLM's CPU build; there ``--gpu-memory-utilization`` would be a share of the RAM."""


def vllm_command(model_path: str, *, host: str, port: int, served_names: tuple[str, ...], max_model_len: int,
                 gpu_memory_utilization: float, gpus: tuple[int, ...], extra_args: tuple[str, ...] = (),
                 kv_cache_gib: int | None = None, executable: str = "vllm") -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` for one worker, and its device's environment: ``CUDA_VISIBLE_DEVICES`` from its placement
    on GPUs, ``VLLM_CPU_KVCACHE_SPACE`` on CPU (``kv_cache_gib``; no GPU share is passed then).

    ``--tensor-parallel-size`` follows the GPU count (a worker on two GPUs shards over both) unless the
    extra arguments set it. Never ``--disable-log-stats``: the agent needs the engine's metrics.
    """
    cmd = [executable, "serve", model_path, "--host", host, "--port", str(port),
           "--served-model-name", *served_names, "--max-model-len", str(max_model_len)]
    if kv_cache_gib is not None:
        env = {CPU_KV_CACHE_ENV: str(kv_cache_gib)}
        cmd += [a for a in extra_args if a != "--disable-log-stats"]
        return cmd, env
    cmd += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if len(gpus) > 1 and not any(a in ("--tensor-parallel-size", "-tp") for a in extra_args):
        cmd += ["--tensor-parallel-size", str(len(gpus))]
    cmd += [a for a in extra_args if a != "--disable-log-stats"]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)} if gpus else {}
    return cmd, env


def worker_command(config: Config, spec: WorkerSpec, port: int,
                   kv_events: KvEventsLaunch | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start one worker. The workers' API key goes in the
    environment (``VLLM_API_KEY``, which vLLM and the simulator read), never on a command line anyone can list."""
    pool = config.pool(spec.pool)
    key = config.worker_api_key()
    lora_args, lora_env = lora_launch(config.catalogue.adapters, pool.model, spec.extra_args)
    extra_env = {**lora_env, **({WORKER_KEY_ENV: key} if key else {})}
    extra_args = (*task_launch(pool.task, spec.backend, spec.extra_args), *role_launch(pool.role, spec.extra_args),
                  *tls_launch(config.tls.local_workers, spec.backend, spec.extra_args), *lora_args,
                  *(kv_events.args if kv_events is not None else ()), *spec.extra_args)
    if spec.backend == "sim":
        cmd = [sys.executable, "-m", "poolgate.cli", "simworker", "--host", spec.host, "--port", str(port),
               "--model", pool.model, "--worker-id", spec.id, "--preset", spec.preset,
               "--max-model-len", str(pool.max_model_len)]
        return [*cmd, *extra_args], extra_env
    assert spec.model_path is not None  # the config validator guarantees it
    cmd, env = vllm_command(spec.model_path, host=spec.host, port=port, served_names=(pool.model,),
                            max_model_len=pool.max_model_len, gpu_memory_utilization=spec.gpu_memory_utilization,
                            gpus=spec.gpus, extra_args=extra_args, kv_cache_gib=spec.kv_cache_gib,
                            executable=spec.vllm_executable)
    return cmd, {**env, **extra_env}


def _signal_group(process: asyncio.subprocess.Process, signum: int) -> None:
    """Signal a worker's whole process group (each starts its own). A real ``vllm serve`` runs its engine core
    and workers as child processes that outlive an API server killed with SIGKILL (seen with vllm-cpu 0.32:
    still running 20 s later, holding the model's memory); only a signal to the group reaches them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


@dataclass
class WorkerProcess:
    spec: WorkerSpec
    port: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    registered: bool = False
    stopping: bool = False
    restart_now: bool = False
    log_path: Path | None = None
    kv_events: KvEventsLaunch | None = None
    """Where the worker publishes its KV-cache events (``extproc.kv_events.enabled``)."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)


WorkerCommand = Callable[[WorkerSpec, int, "KvEventsLaunch | None"], tuple[list[str], dict[str, str]]]
"""A worker's command line and extra environment for a port (``worker_command`` over the config)."""
GpuFacts = Callable[[], Mapping[int, GpuFree]]
"""This node's GPUs as the agent reads them (NVML), or a simulated set."""


class LocalProcessBackend:
    """Starts, supervises and stops workers as child processes of the controller.

    ``command`` gives a worker's command line (``worker_command`` over the config); ``workers`` are the
    configured workers ``start_all`` starts, ``scaling`` the pools' templates ``launch`` starts more from,
    ``settings`` the heartbeat period and TTL of their registrations; ``worker_tls`` the client context for
    workers that serve HTTPS (``tls.workers``: the health check before registration goes over TLS)."""

    name = "local"

    def __init__(self, store: FleetStore, log_dir: Path, command: WorkerCommand, *, pools: Sequence[PoolSpec],
                 workers: Sequence[WorkerSpec], settings: ControllerSettings, placement: PlacementSettings,
                 scaling: Mapping[str, PoolScaling],
                 max_backoff_s: float = 30.0, gpu_facts: GpuFacts | None = None, kv_events: bool = False,
                 worker_tls: ssl.SSLContext | None = None) -> None:
        self._command = command
        self._worker_tls = worker_tls
        self._kv_events = kv_events
        """Start workers publishing their KV-cache events (``extproc.kv_events.enabled``)."""
        self._pools = {pool.name: pool for pool in pools}
        self._configured = tuple(workers)
        self._settings = settings
        self._placement_settings = placement
        self._scaling = scaling
        self._store = store
        self._log_dir = log_dir
        self._max_backoff_s = max_backoff_s
        self._gpu_facts = gpu_facts
        self._node = socket.gethostname()
        """Every worker runs on this machine; its name is the node in their records."""
        self._workers: dict[str, WorkerProcess] = {}
        self._http: aiohttp.ClientSession | None = None
        self._launched = 0
        self.events: list[str] = []
        """Placement refusals and other operator-facing events, newest last."""

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        return self._workers

    def owns(self, worker_id: str) -> bool:
        return worker_id in self._workers

    async def pool_workers(self, pool: str) -> list[str]:
        return sorted(w.spec.id for w in self._workers.values() if w.spec.pool == pool and not w.stopping)

    async def start_all(self, configured: bool = True) -> None:
        """Get ready to run workers, and start the config's (unless ``configured`` is False)."""
        await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(ssl=self._worker_tls or True)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0), connector=connector)
        if configured:
            self.start_configured()

    def start_configured(self) -> list[str]:
        """Start the config's workers not running yet (a controller taking the lease over); their ids."""
        specs = [spec for spec in self._configured if spec.id not in self._workers]
        for spec in specs:
            self._start(spec)
        return [spec.id for spec in specs]

    def _start(self, spec: WorkerSpec) -> WorkerProcess:
        worker = WorkerProcess(spec=spec, port=spec.port, log_path=self._log_dir / f"{spec.id}.log")
        self._assign_ports(worker)
        self._workers[spec.id] = worker
        worker.task = asyncio.create_task(self._supervise(worker), name=f"worker-{spec.id}")
        return worker

    def _assign_ports(self, worker: WorkerProcess) -> None:
        """A free port unless the spec names one, and with KV events a free replay port. A free port is only
        free when it is picked: another process may bind it before the worker does, so a worker that exits
        before it ever served gets new ones (on the same ports it would fail again, for good)."""
        spec = worker.spec
        worker.port = spec.port or free_port(spec.host)
        if self._kv_events:
            worker.kv_events = kv_events_launch(spec.extra_args, spec.host, kv_socket_path(self._log_dir, spec.id),
                                                free_port(spec.host))

    def _next_id(self, pool: str) -> str:
        while True:
            self._launched += 1
            worker_id = f"{pool}-w{self._launched}"
            if worker_id not in self._workers:
                return worker_id

    def _memory_mib(self, pool: str) -> float:
        placement = self._placement_settings
        return placement.model_memory_mib.get(pool, placement.default_memory_mib)

    def _placement(self, pool: str, gpu_count: int) -> Placement:
        need = self._memory_mib(pool)
        gpus = dict(self._gpu_facts()) if self._gpu_facts is not None else {}
        # GPUs promised to workers that are still loading do not show as used yet.
        pending: dict[int, float] = {}
        for worker in self._workers.values():
            if not worker.registered and not worker.stopping:
                held = self._memory_mib(worker.spec.pool)
                for index in worker.spec.gpus:
                    pending[index] = pending.get(index, 0.0) + held
        return place(need, gpu_count, gpus, pending)

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        """Start ``count`` workers from the pool's template; PlacementRefused when no GPU fits one."""
        scaling = self._scaling.get(pool)
        if scaling is None:
            raise KeyError(f"pool {pool!r} has no autoscale.pools entry (bounds and worker template)")
        template = scaling.template
        started: list[str] = []
        for _ in range(count):
            gpus: tuple[int, ...] = ()
            if template.backend == "vllm" and template.kv_cache_gib is None:  # a CPU worker needs no GPU
                placement = self._placement(pool, template.gpu_count)
                if not placement.placed:
                    event = f"pool {pool}: worker not started: {placement.reason}"
                    self.events.append(event)
                    log.warning("%s", event)
                    raise PlacementRefused(event)
                gpus = placement.gpus
            spec = WorkerSpec(id=self._next_id(pool), pool=pool, backend=template.backend, host=template.host,
                              preset=template.preset, model_path=template.model_path, gpus=gpus,
                              gpu_memory_utilization=template.gpu_memory_utilization,
                              kv_cache_gib=template.kv_cache_gib, extra_args=template.extra_args)
            self._start(spec)
            started.append(spec.id)
        return started

    async def stop(self, worker_id: str, grace_s: float = 5.0) -> None:
        """Stop one worker for good (after its drain) and forget it."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.stopping = True
        if worker.task:
            worker.task.cancel()
            await asyncio.gather(worker.task, return_exceptions=True)
        await self._terminate(worker, grace_s)
        if worker.registered:
            with contextlib.suppress(Exception):
                await self._store.deregister(worker_id)
        self._workers.pop(worker_id, None)
        log.info("stopped worker %s", worker_id)

    async def restart(self, worker_id: str) -> None:
        """Kill the process now and start a fresh one without backoff (a hung engine ignores SIGTERM)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.process is None or worker.process.returncode is not None:
            return
        worker.restart_now = True
        _signal_group(worker.process, signal.SIGKILL)

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
                    await self._store.deregister(worker.spec.id)
        if self._http:
            await self._http.close()

    async def _spawn(self, worker: WorkerProcess) -> None:
        cmd, extra_env = self._command(worker.spec, worker.port, worker.kv_events)
        assert worker.log_path is not None
        log_file = worker.log_path.open("ab")
        try:
            worker.process = await asyncio.create_subprocess_exec(
                *cmd, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **extra_env},
                preexec_fn=own_group_dying_with_parent,  # its own group (_signal_group); ends if the controller dies
            )
        finally:
            log_file.close()
        log.info("started worker %s (pid %s) on %s:%s, log %s", worker.spec.id, worker.process.pid,
                 worker.spec.host, worker.port, worker.log_path)

    async def _terminate(self, worker: WorkerProcess, grace_s: float) -> None:
        """End the worker's process for good (it may have ended already) and remove what it left behind."""
        process = worker.process
        if process is not None and process.returncode is None:
            _signal_group(process, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                _signal_group(process, signal.SIGKILL)
                await process.wait()
        if worker.kv_events is not None:
            worker.kv_events.remove_socket()

    async def _probe(self, worker: WorkerProcess) -> bool:
        assert self._http is not None
        try:
            scheme = "https" if self._worker_tls is not None else "http"
            async with self._http.get(f"{scheme}://{worker.spec.host}:{worker.port}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _record(self, worker: WorkerProcess) -> WorkerRecord:
        pool = self._pools[worker.spec.pool]
        return WorkerRecord(id=worker.spec.id, pool=pool.name, model=pool.model, host=worker.spec.host,
                            port=worker.port, max_model_len=pool.max_model_len, backend=worker.spec.backend,
                            node=self._node, state=WorkerState.READY,
                            kv_events_endpoint=worker.kv_events.endpoint if worker.kv_events else "",
                            kv_events_replay_endpoint=worker.kv_events.replay_endpoint if worker.kv_events else "")

    async def _supervise(self, worker: WorkerProcess) -> None:
        settings = self._settings
        backoff = 1.0
        while not worker.stopping:
            await self._spawn(worker)
            assert worker.process is not None
            started = time.monotonic()
            exit_wait = asyncio.create_task(worker.process.wait())
            try:
                while not exit_wait.done():
                    await self._tick(worker)
                    period = settings.heartbeat_interval_s if worker.registered else min(
                        settings.heartbeat_interval_s, LOADING_PROBE_S)
                    await asyncio.wait({exit_wait}, timeout=period)
            finally:
                if not exit_wait.done():
                    exit_wait.cancel()
            if exit_wait.done():  # what it left behind (a killed vLLM's engine core) goes with it
                _signal_group(worker.process, signal.SIGKILL)
            if worker.registered:
                await self._store.deregister(worker.spec.id)
                worker.registered = False
            else:  # it never served: perhaps its port was taken before it could bind it
                self._assign_ports(worker)
            worker.restarts += 1
            if worker.restart_now:
                worker.restart_now = False
                log.warning("worker %s replaced (exit code %s); starting a fresh one", worker.spec.id,
                            worker.process.returncode)
                continue
            log.warning("worker %s exited with code %s; restarting in %.0f s", worker.spec.id,
                        worker.process.returncode, backoff)
            if time.monotonic() - started > 60:
                backoff = 1.0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _tick(self, worker: WorkerProcess) -> None:
        """Before registration: wait for a good /health. After: keep the registration alive."""
        ttl = self._settings.heartbeat_ttl_s
        if not worker.registered:
            if await self._probe(worker):
                await self._store.register(self._record(worker), ttl)
                worker.registered = True
                log.info("worker %s is ready at %s:%s", worker.spec.id, worker.spec.host, worker.port)
            return
        alive = await self._store.heartbeat(worker.spec.id, ttl)
        if not alive:  # the registration expired (Redis restarted, long pause): register again
            await self._store.register(self._record(worker), ttl)
