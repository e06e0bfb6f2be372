"""``poolgate up``: the whole stack on one machine — Redis, controller (+ workers), extproc (one process per
core: ``extproc.processes``; process i on ``ports.extproc`` + i when that is set; the first serves its
metrics on ``extproc_metrics_port``, the others on free ports listed in ``extproc.json``), Envoy.

It owns every child's lifecycle: each runs in its own process group and dies with ``up`` (parent-death
signal), so SIGINT/SIGTERM, a crashed child or a failed start leave no orphan process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import yaml

from poolgate.kernel.child_process import own_group_dying_with_parent
from poolgate.kernel.config import Config, ConfigError, PoolTask, load_config
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.store import connect
from poolgate.procs import envoy_binary, free_port, wait_port
from poolgate.status import fleet_table, redis_url_argument

READY_TIMEOUT_S = 120.0
READY_TIMEOUT_VLLM_S = 600.0
"""With real ``vllm serve`` workers: an engine imports, loads its weights and compiles before its port opens
(a minute for a tiny model on two CPU cores, several with two at once; more for large models on GPUs)."""


def ready_timeout(config: Config) -> float:
    """How long ``up`` waits for its pools to serve: longer when a configured worker is a real vLLM."""
    return READY_TIMEOUT_VLLM_S if any(w.backend == "vllm" for w in config.workers) else READY_TIMEOUT_S


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process
    log_path: Path
    restarts: int = 0


@dataclass(frozen=True)
class StackPorts:
    envoy: int
    admin: int
    extproc: tuple[int, ...]
    """One port per extproc process (``extproc.processes``)."""
    xds: int
    controller_http: int
    extproc_metrics: tuple[int, ...] = ()
    """The extproc processes' metrics ports (none when ``observability.extproc_metrics_port`` is unset)."""
    pd_sidecar: int | None = None
    """The prefill/decode sidecar's port, when a pool has ``role: prefill``."""

    @classmethod
    def all_free(cls, extproc_processes: int) -> StackPorts:
        """Free ports for everything (benchmarks and tests that start their own stack)."""
        return cls(envoy=free_port(), admin=free_port(), extproc=tuple(free_port() for _ in range(extproc_processes)),
                   xds=free_port(), controller_http=free_port())


def port_picker(taken: Iterable[int | None]) -> Callable[[], int]:
    """``free_port``, but never a port the configuration already names for this stack. Envoy and gRPC both
    listen with ``SO_REUSEPORT``: two of the stack's servers would then share one port without an error (seen:
    Envoy's listener on extproc's port, sending ext_proc calls to itself)."""
    chosen = {port for port in taken if port}

    def pick() -> int:
        port = free_port()
        while port in chosen:
            port = free_port()
        chosen.add(port)
        return port

    return pick


class Stack:
    """Starts the children in dependency order and stops them all, whatever state they are in."""

    def __init__(self, config: Config, config_path: Path, run_dir: Path, ports: StackPorts,
                 redis_url: str | None, listen_host: str) -> None:
        self.config = config
        self.config_path = config_path
        self.run_dir = run_dir
        self.ports = ports
        self.redis_url = redis_url
        self.listen_host = listen_host
        self.children: list[Child] = []
        self.token = config.controller.resolved_token() or secrets.token_urlsafe(24)

    async def _exec(self, cmd: list[str], env: dict[str, str], log_path: Path) -> asyncio.subprocess.Process:
        with log_path.open("ab") as log_file:
            return await asyncio.create_subprocess_exec(
                *cmd, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **env}, preexec_fn=own_group_dying_with_parent,
            )

    async def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.run_dir / f"{name}.log"
        child = Child(name, cmd, env or {}, await self._exec(cmd, env or {}, log_path), log_path)
        self.children.append(child)
        self._write_pids()
        return child

    async def restart(self, child: Child) -> None:
        """Start a child that exited again, with the same command (its port and state come back)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)  # leftovers of its group (a crashed controller's workers)
        child.process = await self._exec(child.cmd, child.env, child.log_path)
        child.restarts += 1
        self._write_pids()

    def _write_pids(self) -> None:
        """``children.json`` in the run directory: name → pid, for operators and fault tests."""
        pids = {c.name: c.process.pid for c in self.children}
        staging = self.run_dir / "children.json.tmp"
        staging.write_bytes(orjson.dumps(pids))
        staging.replace(self.run_dir / "children.json")  # atomic: a reader never sees a half-written file

    async def _await_port(self, child: Child, port: int, timeout_s: float) -> None:
        waiter = asyncio.create_task(wait_port("127.0.0.1", port, timeout_s))
        exited = asyncio.create_task(child.process.wait())
        done, _ = await asyncio.wait({waiter, exited}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        exited.cancel()
        if exited in done or not waiter.result():
            raise RuntimeError(f"{child.name} did not come up (log: {child.log_path}):\n{_tail(child.log_path)}")

    async def start(self) -> None:
        python = [sys.executable, "-m", "poolgate.cli"]
        if self.redis_url is None:
            redis_port = free_port()
            server = shutil.which("redis-server")
            if server is None:
                raise RuntimeError("redis-server not found: install it (apt-get install redis-server) "
                                   "or pass --redis-url")
            child = await self._spawn("redis", [server, "--port", str(redis_port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)])
            await self._await_port(child, redis_port, 15)
            self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        common = ["--config", str(self.config_path), "--redis-url", self.redis_url]
        controller = await self._spawn(
            "controller",
            [*python, "controller", *common, "--xds-port", str(self.ports.xds),
             "--http-port", str(self.ports.controller_http), "--log-dir", str(self.run_dir / "workers")],
            env={self.config.controller.token_env: self.token},
        )
        extprocs = await self._spawn_extprocs([*python, "extproc", *common])
        await self._spawn_pd_sidecar(python)
        await self._await_port(controller, self.ports.xds, 30)
        for extproc, port in zip(extprocs, self.ports.extproc, strict=True):
            await self._await_port(extproc, port, 30)
        from controller.xds.bootstrap import render_bootstrap
        from controller.xds.envoy_tls import write_sds_files

        write_sds_files(self.config.tls)  # Envoy's certificate files, named for SDS (tls.envoy, tls.workers)
        bootstrap = render_bootstrap(self.config, node_id="poolgate-local", listen_port=self.ports.envoy,
                                     admin_port=self.ports.admin, extproc_port=self.ports.extproc,
                                     xds_port=self.ports.xds, listen_host=self.listen_host,
                                     access_log_path=str(self.run_dir / "envoy-access.log"),
                                     pd_sidecar_port=self.ports.pd_sidecar)
        bootstrap_path = self.run_dir / "envoy.yaml"
        bootstrap_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        envoy = await self._spawn("envoy", [str(envoy_binary()), "-c", str(bootstrap_path), "-l", "warning",
                                            "--use-dynamic-base-id", "--disable-hot-restart"])
        await self._await_port(envoy, self.ports.admin, 30)

    async def _spawn_pd_sidecar(self, python: list[str]) -> None:
        """The sidecar that runs split requests' two steps, for a config with prefill pools."""
        port = self.ports.pd_sidecar
        if port is None:
            return
        child = await self._spawn("pd-sidecar", [*python, "pd-sidecar", "--config", str(self.config_path),
                                                 "--port", str(port)])
        await self._await_port(child, port, 30)

    async def _spawn_extprocs(self, command: list[str]) -> list[Child]:
        """One extproc per port; ``extproc.json`` in the run directory names each one's ports."""
        names = [f"extproc-{i}" if i else "extproc" for i in range(len(self.ports.extproc))]
        metrics = self.ports.extproc_metrics or (None,) * len(names)
        listed = {name: {"port": port, "metrics_port": metrics_port}
                  for name, port, metrics_port in zip(names, self.ports.extproc, metrics, strict=True)}
        (self.run_dir / "extproc.json").write_bytes(orjson.dumps(listed))
        siblings = ["--siblings", ",".join(map(str, self.ports.extproc))] if len(self.ports.extproc) > 1 else []
        return [await self._spawn(name, [*command, "--port", str(port), *siblings,
                                         *(["--metrics-port", str(m)] if m else [])])
                for name, port, m in zip(names, self.ports.extproc, metrics, strict=True)]

    async def wait_until_serving(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until one request per model that should be served succeeds through Envoy (workers load, xDS arrives),
        each of the kind its pool's task serves, and the model list answers. Pools that start empty (no configured
        worker, and no ``min_workers`` above 0) are not asked: a request would wake a pool scaled to zero."""
        deadline = time.monotonic() + timeout_s
        tasks = serving_models(self.config)
        pending = set(tasks) | {LIST_MODELS}
        keys_required = self.config.tenancy.require_api_key
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while pending:
                for model in sorted(pending):
                    if model == LIST_MODELS:
                        answered = await _models_ok(http, self.base_url, keys_required)
                    else:
                        answered = await _serves(http, self.base_url, model, tasks[model], keys_required)
                    if answered:
                        pending.discard(model)
                self.raise_if_child_died()
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"stack not serving {', '.join(sorted(pending))} after {timeout_s:.0f} s "
                                       f"(logs in {self.run_dir})")
                if pending:
                    await asyncio.sleep(0.2)

    def raise_if_child_died(self) -> None:
        for child in self.children:
            if child.process.returncode is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} "
                                   f"(log: {child.log_path}):\n{_tail(child.log_path)}")

    async def wait_for_child_exit(self) -> Child:
        waits = {asyncio.create_task(c.process.wait()): c for c in self.children}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waits[done.pop()]

    async def stop(self, grace_s: float = 8.0) -> None:
        """Stop newest first (Envoy before the controller before Redis): SIGTERM, wait, then SIGKILL the group.

        Killing the whole process group also takes the controller's workers when the controller crashed.
        """
        for child in reversed(self.children):
            await self.stop_child(child, grace_s)

    @staticmethod
    async def stop_child(child: Child, grace_s: float = 8.0) -> None:
        """One child and its process group: SIGTERM, wait up to ``grace_s``, then SIGKILL what is left."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.process.wait(), grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)
        if child.process.returncode is None:
            await child.process.wait()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.envoy}/v1"


LIST_MODELS = "GET /v1/models"
"""Stands for the model list among the models ``wait_until_serving`` waits for."""


def serving_models(config: Config) -> dict[str, PoolTask]:
    """Models whose pools should serve once the stack is up (a configured worker, or a ``min_workers`` above
    0 that the autoscaler starts), with what they do (the loader holds every pool of a model to one task)."""
    scaled = config.autoscale.pools if config.autoscale.enabled else {}
    with_workers = {w.pool for w in config.workers}
    return {p.model: p.task for p in sorted(config.pools, key=lambda p: p.model)
            if p.name in with_workers or (p.name in scaled and scaled[p.name].min_workers > 0)}


async def _models_ok(http: aiohttp.ClientSession, base_url: str, keys_required: bool) -> bool:
    try:
        async with http.get(f"{base_url}/models") as response:
            await response.read()
            return response.status == 200 or (keys_required and response.status == 401)
    except (aiohttp.ClientError, TimeoutError):
        return False


def readiness_probe(model: str, task: PoolTask) -> tuple[str, dict[str, object]]:
    """The smallest request a worker of this kind answers with 200: its path and body. A pooling model refuses
    chat, and a speech model takes only uploads, so each kind is asked its own way (a speech model through
    ``/tokenize``, which every kind serves)."""
    if task == "embed":
        return "/v1/embeddings", {"model": model, "input": "ping"}
    if task == "score":
        return "/v1/score", {"model": model, "text_1": "ping", "text_2": "pong"}
    if task == "transcription":
        return "/tokenize", {"model": model, "prompt": "ping"}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "ping"}],
                                    "max_tokens": 1}


async def _serves(http: aiohttp.ClientSession, base_url: str, model: str, task: PoolTask,
                  keys_required: bool = False) -> bool:
    """With API keys required the probe has no key (the config holds only hashes): extproc's 401 then shows
    the router is up, not that the model's workers are."""
    path, body = readiness_probe(model, task)
    try:
        async with http.post(base_url.removesuffix("/v1") + path, json=body) as response:
            await response.read()
            return response.status == 200 or (keys_required and response.status == 401)
    except (aiohttp.ClientError, TimeoutError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def demo_load(base_url: str, models: list[str], requests: int = 48, concurrency: int = 8) -> str:
    """A short mixed load (chat and completions, streaming and not) with a per-worker summary."""
    per_worker: dict[str, list[float]] = {}
    failures = 0
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int, http: aiohttp.ClientSession) -> None:
        nonlocal failures
        model = models[index % len(models)]
        stream = index % 3 == 0
        words = " ".join(["lorem"] * (20 + 150 * (index % 4)))
        if index % 2:
            path = "chat/completions"
            body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": words}]}
        else:
            path, body = "completions", {"model": model, "prompt": words}
        body |= {"max_tokens": 16 + 8 * (index % 5), "stream": stream}
        async with semaphore:
            started = time.perf_counter()
            try:
                async with http.post(f"{base_url}/{path}", data=orjson.dumps(body),
                                     headers={"content-type": "application/json"}) as response:
                    await response.read()
                    worker = response.headers.get("x-poolgate-worker", "?")
                    if response.status != 200:
                        failures += 1
                        return
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
                return
            per_worker.setdefault(f"{model} @ {worker}", []).append(time.perf_counter() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        await asyncio.gather(*(one(i, http) for i in range(requests)))
    lines = [f"demo: {requests} requests, concurrency {concurrency}, {failures} failed"]
    for key in sorted(per_worker):
        latencies = sorted(per_worker[key])
        lines.append(f"  {key:<40} {len(latencies):>3} requests, median {latencies[len(latencies) // 2] * 1000:.0f} ms")
    return "\n".join(lines)


def _resolve_ports(config: Config, args: argparse.Namespace) -> StackPorts:
    ports = config.ports
    processes, metrics = config.extproc.process_count(), config.observability.extproc_metrics_port
    pick = port_picker((args.port, args.admin_port, ports.envoy, ports.envoy_admin, ports.xds, ports.controller_http,
                        metrics, config.disaggregation.sidecar_port,
                        *(ports.extproc + i for i in range(processes) if ports.extproc)))
    return StackPorts(
        envoy=args.port if args.port is not None else (ports.envoy or pick()),
        admin=args.admin_port if args.admin_port is not None else (ports.envoy_admin or pick()),
        extproc=tuple(ports.extproc + i if ports.extproc else pick() for i in range(processes)),
        extproc_metrics=(metrics, *(pick() for _ in range(processes - 1))) if metrics else (),
        xds=ports.xds or pick(),
        controller_http=ports.controller_http or pick(),
        pd_sidecar=(config.disaggregation.sidecar_port or pick()) if config.disaggregated_models() else None,
    )


async def _redis_reachable(url: str) -> bool:
    client = connect(url, max_connections=None, socket_connect_timeout=1)
    try:
        return bool(await client.ping())
    except REDIS_ERRORS:
        return False
    finally:
        await client.aclose()


async def run_up(args: argparse.Namespace) -> int:
    config_path = Path(args.config)
    config = load_config(config_path)
    config.worker_api_key()  # Envoy and the controller both need it: refuse before starting either
    redis_url = args.redis_url or config.redis_url
    if redis_url and not await _redis_reachable(redis_url):
        if args.redis_url:
            print("up: Redis at --redis-url is not reachable; start it or omit --redis-url", file=sys.stderr)
            return 2
        print("up: the config's Redis is not reachable; starting a private redis-server instead")
        redis_url = None
    run_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="poolgate-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(config, config_path, run_dir, _resolve_ports(config, args), redis_url, args.listen_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        starting = asyncio.create_task(_start_and_wait(stack))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            print("up: interrupted while starting; stopping")
            return 130
        starting.result()
        assert stack.redis_url is not None
        print(f"READY {stack.base_url}", flush=True)
        print(await fleet_table(stack.redis_url, config.key_prefix))
        model = config.pools[0].model
        print(f"\nTry:\n  curl -s {stack.base_url}/chat/completions -H 'content-type: application/json' \\\n"
              f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
        print(f"Envoy admin: http://127.0.0.1:{stack.ports.admin}  logs: {run_dir}  "
              f"status: poolgate status --redis-url {redact_url(stack.redis_url)}", flush=True)
        if args.demo:
            print(await demo_load(stack.base_url, sorted({p.model for p in config.pools})), flush=True)
        if args.exit_after_demo:
            return 0
        print("Serving; Ctrl-C stops everything.", flush=True)
        code = await supervise(stack, stop)
    except (RuntimeError, ConfigError, FileNotFoundError) as exc:
        print(f"up: {exc}", file=sys.stderr)
        code = 1
    finally:
        await stack.stop()
        print("up: stopped", flush=True)
    return code


async def supervise(stack: Stack, stop: asyncio.Event, max_restarts: int = 5) -> int:
    """Restart a child that exits (after a short backoff) until ``stop``; give up after ``max_restarts``."""
    stopped = asyncio.create_task(stop.wait())
    while True:
        child_exit = asyncio.create_task(stack.wait_for_child_exit())
        await asyncio.wait({child_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            child_exit.cancel()
            return 0
        child = child_exit.result()
        if child.restarts >= max_restarts:
            print(f"up: {child.name} keeps exiting (code {child.process.returncode}, log {child.log_path}); "
                  "stopping everything", file=sys.stderr, flush=True)
            stopped.cancel()
            return 1
        delay = min(8.0, 0.5 * 2 ** child.restarts)
        print(f"up: {child.name} exited with code {child.process.returncode}; restarting in {delay:.1f} s "
              f"(log {child.log_path})", file=sys.stderr, flush=True)
        await asyncio.wait({stopped}, timeout=delay)
        if stopped.done():
            return 0
        await stack.restart(child)


async def _start_and_wait(stack: Stack) -> None:
    await stack.start()
    await stack.wait_until_serving(ready_timeout(stack.config))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--port", type=int, help="Envoy listener port (default: config ports.envoy)")
    parser.add_argument("--admin-port", type=int, help="Envoy admin port (default: a free port)")
    parser.add_argument("--redis-url", type=redis_url_argument, help="use this Redis instead of starting one")
    parser.add_argument("--listen-host", default="127.0.0.1", help="address Envoy listens on")
    parser.add_argument("--log-dir", help="where child logs go (default: a new temporary directory)")
    parser.add_argument("--demo", action="store_true", help="send a short demo load once ready")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop once ready (and after the demo)")


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(run_up(args))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

