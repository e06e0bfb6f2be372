"""One simulated worker's lifecycle: build its parts, listen, run the engine, die on cue.

``SimWorker.serve(stop)`` owns everything the worker starts (listener, driver loop, fault timers) and
returns once ``stop`` is set or the worker crashed (see ``faults`` for what a crash means).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from aiohttp import web

from poolgate.kernel.config import TlsServerFiles
from poolgate.kernel.tls import ServerTls
from simworker import tokens
from simworker.driver import EngineDriver
from simworker.engine import Engine, EngineConfig
from simworker.faults import FaultSettings
from simworker.kv_events import KVEventRecorder
from simworker.kv_publisher import KVEventsConfig, ZmqKVEventPublisher
from simworker.kv_transfer import KVTransferConfig
from simworker.kv_transfer_http import KVTransferAgent
from simworker.lora import DEFAULT_MAX_LORA_RANK, AdapterTable
from simworker.metrics import WorkerMetrics
from simworker.model_endpoints import install as install_model_endpoints
from simworker.model_tasks import ModelTasks
from simworker.presets import STEP_JITTER, GpuPreset, ModelShape, default_num_gpu_blocks, step_cost
from simworker.server import Health, ServingConfig, WorkerApi
from simworker.sleep_mode import SleepMode

log = logging.getLogger(__name__)

CRASH_LINGER_S = 1.0
SHUTDOWN_TIMEOUT_S = 0.5
LEAK_INTERVAL_S = 0.25
TLS_RELOAD_S = 5.0
"""How often an HTTPS worker looks at its certificate files (a rotated one is served from then on)."""


@dataclass(frozen=True)
class WorkerSpec:
    port: int
    worker_id: str
    preset: GpuPreset
    host: str = "127.0.0.1"
    model_name: str = "sim-llama-3-8b"
    model_root: str = "meta-llama/Meta-Llama-3-8B-Instruct"
    model: ModelShape = field(default_factory=ModelShape)
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    """On by default, as in vLLM V1."""
    legacy_kv_metric: bool = False
    time_scale: float = 1.0
    faults: FaultSettings = field(default_factory=FaultSettings)
    enable_fault_api: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    lora_load_s: float = 0.0
    runtime_lora_updating: bool = False
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` was set: serve the adapter load/unload endpoints."""
    api_key: str | None = None
    """Required on ``/v1`` paths, as vLLM's ``--api-key``."""
    tasks: ModelTasks = field(default_factory=ModelTasks)
    """Generative, embedding, cross-encoder or speech-to-text model: which endpoints it serves."""
    seed: int = 0
    """Seeds the worker's own randomness (step-time jitter, the error-rate fault) with its id; never the
    answers' lengths, which depend on the request alone."""
    step_jitter: float = STEP_JITTER
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    """vLLM's ``--kv-events-config``; publishes nothing by default, as vLLM."""
    kv_transfer: KVTransferConfig | None = None
    """vLLM's ``--kv-transfer-config``: a prefill (``kv_producer``) or decode (``kv_consumer``) worker of a
    disaggregated pair, or both (``kv_both``); None = neither."""
    tls: TlsServerFiles | None = None
    """Serve HTTPS from these files (vLLM's ``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certs`` with
    client certificates required), re-read when they change."""
    startup_delay_s: float = 0.0
    """Model load: the port opens only this long after start (vLLM listens once its engine is built), so
    ``/health`` refuses connections and the controller registers the worker only after it."""
    enable_sleep_mode: bool = False
    """vLLM's ``--enable-sleep-mode``: serve ``/sleep``, ``/wake_up``, ``/is_sleeping`` (``simworker.sleep_mode``)."""
    wake_up_s: float = 1.0
    """What a wake-up from sleep costs, in seconds (a cold start costs ``startup_delay_s``)."""

    @property
    def random_seed(self) -> int:
        return tokens.stable_hash(f"{self.seed}/{self.worker_id}")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_gpu_blocks=self.num_gpu_blocks or default_num_gpu_blocks(self.preset, self.model, self.block_size),
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs or self.preset.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or self.preset.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            cost=step_cost(self.preset, self.model),
            step_jitter=self.step_jitter,
            seed=self.random_seed,
        )


class SimWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.engine_config = spec.engine_config()
        self.kv_events = KVEventRecorder(self.engine_config.block_size) if spec.kv_events.publishes else None
        self.engine = Engine(self.engine_config, self.kv_events)  # validates the sizing before anything listens
        self.listening = asyncio.Event()
        self.crashed = asyncio.Event()
        self._faults = spec.faults
        self._inference_requests = 0
        self._started_at = 0.0
        self._driver: EngineDriver | None = None
        self._transfer: KVTransferAgent | None = None

    @property
    def health(self) -> Health:
        if self.crashed.is_set():
            return "dead"
        if asyncio.get_running_loop().time() - self._started_at < self._faults.slow_start_s:
            return "starting"
        return "ready"

    def kv_transfer_held(self) -> int:
        """Prefills whose KV this (producer) worker still holds for a decode worker."""
        return self._transfer.blocks.held if self._transfer is not None else 0

    @property
    def faults(self) -> FaultSettings:
        return self._faults

    def set_faults(self, faults: FaultSettings) -> None:
        log.info("worker %s faults now %s", self.spec.worker_id, faults)
        self._faults = faults

    def note_inference_request(self) -> None:
        self._inference_requests += 1
        limit = self._faults.crash_after_requests
        if limit is not None and self._inference_requests > limit:
            self.crash(f"crash_after_requests={limit} reached")

    def crash(self, reason: str) -> None:
        if self.crashed.is_set():
            return
        log.warning("worker %s crashes: %s", self.spec.worker_id, reason)
        self.crashed.set()
        if self._driver is not None:
            self._driver.kill()

    async def serve(self, stop: asyncio.Event) -> None:
        spec, config = self.spec, self.engine_config
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        kv_block_bytes = spec.model.kv_bytes_per_token * spec.block_size
        metrics = WorkerMetrics(spec.model_name, self._cache_config_labels(), spec.preset.memory_bytes,
                                spec.legacy_kv_metric, spec.time_scale)
        publisher = (ZmqKVEventPublisher(spec.kv_events, zmq.asyncio.Context.instance())
                     if self.kv_events is not None else None)
        recorder = self.kv_events
        flush = (lambda: publisher.publish(recorder.take())) if publisher and recorder else None
        driver = EngineDriver(self.engine, metrics, time_scale=spec.time_scale,
                              weight_bytes=spec.model.weight_bytes, kv_block_bytes=kv_block_bytes,
                              flush_kv_events=flush)
        self._driver = driver
        serving = ServingConfig(
            worker_id=spec.worker_id, model_name=spec.model_name, model_root=spec.model_root,
            max_model_len=config.max_model_len, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching, enable_fault_api=spec.enable_fault_api,
            runtime_lora_updating=spec.enable_lora and spec.runtime_lora_updating, lora_load_s=spec.lora_load_s,
            api_key=spec.api_key,
        )
        adapters = AdapterTable(spec.max_loras, metrics.registry, spec.max_lora_rank) if spec.enable_lora else None
        transfer = None
        if spec.kv_transfer is not None:
            transfer = KVTransferAgent(spec.kv_transfer, spec.kv_transfer.engine_id or spec.worker_id, spec.host,
                                       spec.port, config.block_size, spec.model.kv_bytes_per_token,
                                       spec.time_scale, driver.model_now)
        self._transfer = transfer
        api = WorkerApi(serving, driver, metrics, self, random.Random(spec.random_seed + 1), adapters, transfer)
        app = api.build_app()
        if spec.enable_sleep_mode:
            SleepMode(spec.worker_id, spec.wake_up_s, metrics.registry).install(app)
        install_model_endpoints(app, api, spec.tasks)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        tls = ServerTls(spec.tls, "simworker --ssl-certfile/--ssl-keyfile") if spec.tls is not None else None
        try:
            if spec.startup_delay_s:
                log.info("worker %s loading its model for %.1f s", spec.worker_id, spec.startup_delay_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), spec.startup_delay_s)
                if stop.is_set():
                    return
            await web.TCPSite(runner, spec.host, spec.port, reuse_address=True,
                              ssl_context=tls.context if tls is not None else None).start()
            self.listening.set()
            log.info("worker %s (%s, %d KV blocks) listening on %s:%d", spec.worker_id, spec.preset.name,
                     config.num_gpu_blocks, spec.host, spec.port)
            async with asyncio.TaskGroup() as tasks:
                background = [tasks.create_task(driver.run()), tasks.create_task(self._leak_loop(driver)),
                              tasks.create_task(self._crash_timer())]
                if publisher is not None:
                    background.append(tasks.create_task(publisher.serve_replays()))
                if tls is not None:
                    background.append(tasks.create_task(tls.watch(TLS_RELOAD_S)))
                await _first_of(stop.wait(), self.crashed.wait())
                if self.crashed.is_set() and not stop.is_set():
                    await _first_of(asyncio.sleep(CRASH_LINGER_S), stop.wait())
                driver.kill()
                for task in background:
                    task.cancel()
        finally:
            if publisher is not None:
                publisher.close()
            if transfer is not None:
                await transfer.close()
            await runner.cleanup()

    async def _leak_loop(self, driver: EngineDriver) -> None:
        owed = 0.0
        while True:
            await asyncio.sleep(LEAK_INTERVAL_S)
            owed += self._faults.kv_leak_blocks_per_s * LEAK_INTERVAL_S
            if owed >= 1:
                driver.leak_blocks(int(owed))
                owed -= int(owed)

    async def _crash_timer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            crash_at = self._faults.crash_at_s
            if crash_at is not None and loop.time() - self._started_at >= crash_at:
                self.crash(f"crash_at_s={crash_at} reached")
                return
            await asyncio.sleep(0.1)

    def _cache_config_labels(self) -> dict[str, str]:
        config = self.engine_config
        return {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "kv_cache_size_tokens": str(config.num_gpu_blocks * config.block_size),
            "gpu_memory_utilization": str(self.spec.preset.gpu_memory_utilization),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": "auto",
            "num_gpu_blocks_override": str(self.spec.num_gpu_blocks),
        }


async def _first_of(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of several coroutines finishes, cancelling the rest."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
