"""The scheduling benchmark's fleet: one poolgate stack and one baseline Envoy in front of the same workers.

Ten simulated workers, started by poolgate's own controller (``Stack``) with a slowed-down clock:

- chat model: 6 × ``l4-24gb`` (35k KV tokens, ~68 ms decode step) and 2 × ``h100-80gb`` (450k, ~8 ms);
- code model: 1 × ``h100-80gb`` and 1 × ``l4-24gb``.

The poolgate side is the product path (Envoy → ext_proc → pinned worker). The baseline Envoy has no
ext_proc and STATIC clusters with the same worker addresses (see ``baseline_envoy``). Worker ports are
fixed in the generated config so both Envoys know them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
import yaml

from bench.baseline_envoy import BENCH_CLUSTER_HEADER, baseline_bootstrap, baseline_cluster
from bench.harness import ProcessGroup, scrape
from bench.loadgen import Target
from bench.workload import ModelRole, RequestSpec
from poolgate.kernel.config import load_config
from poolgate.kernel.store import FleetStore
from poolgate.procs import envoy_binary, free_port, wait_port
from poolgate.up import Stack, StackPorts

MODELS: dict[ModelRole, str] = {"chat": "llama-3.1-8b-instruct", "code": "qwen2.5-coder-7b"}
POOL_OF_ROLE: dict[ModelRole, str] = {"chat": "chat", "code": "code"}
POOL_MAX_MODEL_LEN = {"chat": 18432, "code": 4096}
KEY_PREFIX = "bench"


@dataclass(frozen=True)
class WorkerPlan:
    id: str
    pool: str
    preset: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_workers() -> list[WorkerPlan]:
    layout = [("chat", "l4-24gb", 6), ("chat", "h100-80gb", 2), ("code", "h100-80gb", 1), ("code", "l4-24gb", 1)]
    plans: list[WorkerPlan] = []
    for pool, preset, count in layout:
        for number in range(1, count + 1):
            short = "l4" if preset.startswith("l4") else "h100"
            plans.append(WorkerPlan(f"{pool}-{short}-{number}", pool, preset, free_port()))
    return plans


def fleet_config(workers: list[WorkerPlan], time_scale: float) -> dict[str, object]:
    """The poolgate config of the benchmark (YAML-shaped)."""
    return {
        "key_prefix": KEY_PREFIX,
        "ports": {"envoy": 0},
        # Generous TTL: a loaded 2-core host must not drop workers from Envoy between heartbeats.
        "controller": {"heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 5.0},
        "scheduling": {"task_classes": {"code_models": [MODELS["code"]]}},
        "pools": [{"name": pool, "model": MODELS[role], "max_model_len": POOL_MAX_MODEL_LEN[pool]}
                  for role, pool in POOL_OF_ROLE.items()],
        "workers": [{"id": w.id, "pool": w.pool, "backend": "sim", "preset": w.preset, "port": w.port,
                     "extra_args": ["--time-scale", repr(time_scale), "--log-level", "WARNING"]}
                    for w in workers],
    }


class BenchFleet:
    """Owns every process of the benchmark; ``stop`` always leaves none behind."""

    def __init__(self, run_dir: Path, time_scale: float) -> None:
        self.run_dir = run_dir
        self.time_scale = time_scale
        self.workers = plan_workers()
        self.baseline_port = free_port()
        self.baseline = ProcessGroup(run_dir)
        config_path = run_dir / "poolgate.yaml"
        config_path.write_text(yaml.safe_dump(fleet_config(self.workers, time_scale), sort_keys=False))
        self.config = load_config(config_path)
        ports = StackPorts(envoy=free_port(), admin=free_port(), extproc=free_port(), xds=free_port(),
                           controller_http=free_port())
        self.stack = Stack(self.config, config_path, run_dir, ports, None, "127.0.0.1")

    async def start(self, session: aiohttp.ClientSession) -> None:
        await self.stack.start()
        pools: dict[str, list[tuple[str, int]]] = {}
        for worker in self.workers:
            pools.setdefault(worker.pool, []).append(("127.0.0.1", worker.port))
        bootstrap_path = self.run_dir / "envoy-baseline.yaml"
        bootstrap_path.write_text(yaml.safe_dump(baseline_bootstrap(pools, listen_port=self.baseline_port,
                                                                     admin_port=free_port())))
        self.baseline.start("envoy-baseline", [str(envoy_binary()), "-c", str(bootstrap_path), "-l", "warning",
                                               "--use-dynamic-base-id", "--disable-hot-restart"])
        if not await wait_port("127.0.0.1", self.baseline_port, 30):
            raise RuntimeError(f"the baseline Envoy did not start (log in {self.run_dir})")
        await self.stack.wait_until_serving()

    async def stop(self) -> None:
        self.baseline.stop_all()
        await self.stack.stop()

    def target(self, policy: str) -> Target:
        if policy == "poolgate":
            return Target(policy, f"http://127.0.0.1:{self.stack.ports.envoy}", lambda spec: {})

        def headers(spec: RequestSpec) -> Mapping[str, str]:
            return {BENCH_CLUSTER_HEADER: baseline_cluster(POOL_OF_ROLE[spec.role], policy)}
        return Target(policy, f"http://127.0.0.1:{self.baseline_port}", headers)

    async def scrape_all(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
        scrapes = await asyncio.gather(*(scrape(session, w.url) for w in self.workers))
        return {w.id: s for w, s in zip(self.workers, scrapes, strict=True)}

    async def wait_idle(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> bool:
        """Until every worker reports nothing running or waiting; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            scrapes = await self.scrape_all(session)
            if all(s["vllm:num_requests_running"] + s["vllm:num_requests_waiting"] == 0 for s in scrapes.values()):
                return True
            await asyncio.sleep(0.2)
        return False

    async def wait_agent_data(self, timeout_s: float) -> bool:
        """Until every worker's Redis record carries live KV data (the agent is scraping); False on timeout."""
        assert self.stack.redis_url is not None
        redis = aioredis.from_url(self.stack.redis_url)
        store = FleetStore(redis, self.config.key_prefix)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                records = await store.read_fleet()
                ids = {r.id for r in records if r.kv_capacity_tokens > 0}
                if ids >= {w.id for w in self.workers}:
                    return True
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.25)
        finally:
            await redis.aclose()

    async def ensure_agent(self, wait_s: float) -> str:
        """Live KV data in Redis for every worker: from the controller's agent if it runs one, else from a
        ``poolgate agent`` process started here. Returns who provides it (or that nobody does)."""
        if await self.wait_agent_data(wait_s):
            return "controller"
        assert self.stack.redis_url is not None
        self.baseline.start("agent", [sys.executable, "-m", "poolgate.cli", "agent", "--config",
                                      str(self.stack.config_path), "--redis-url", self.stack.redis_url,
                                      "--log-level", "WARNING"])
        if await self.wait_agent_data(wait_s):
            return "separate poolgate agent process"
        return "none (no live KV data in Redis)"

    async def check_baseline(self, session: aiohttp.ClientSession) -> None:
        """One tiny request per pool through the baseline Envoy."""
        for role, model in MODELS.items():
            cluster = baseline_cluster(POOL_OF_ROLE[role], "least_request")
            body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
            async with session.post(f"http://127.0.0.1:{self.baseline_port}/v1/chat/completions", json=body,
                                    headers={BENCH_CLUSTER_HEADER: cluster}) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"baseline Envoy answered {response.status} for {model}")
