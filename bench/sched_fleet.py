"""The benchmarks' fleet: simulated workers started by poolgate's own stack, and a baseline Envoy in front
of the same workers.

Two layouts (``LAYOUTS``), each with a chat and a code pool:

- ``heterogeneous``: chat 6 × ``l4-24gb`` (35k KV tokens, ~68 ms decode step) + 2 × ``h100-80gb`` (450k,
  ~8 ms); code 1 × ``h100-80gb`` + 1 × ``l4-24gb``;
- ``homogeneous``: chat 3 × ``h100-80gb``; code 1 × ``h100-80gb`` (H100s rather than L4s: an all-L4 fleet
  serves about one long-document request per second, too few for a p99 within a run that fits the host).

The poolgate side is the product path (Envoy → ext_proc → pinned worker). The baseline Envoy has no
ext_proc and STATIC clusters with the same worker addresses (see ``baseline_envoy``); it is restarted
with new per-worker weights when the capacity of each worker has been measured. Worker ports are fixed in
the generated config so every router knows them.

The engines run ``time_scale`` times real speed, so every control-loop interval and time bound of
poolgate's config is divided by it (``scaled_settings``): in model time the agent scrapes, extproc
refreshes and holds requests exactly as often and as long as with the defaults on real GPUs.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import yaml

from bench.baseline_envoy import BENCH_CLUSTER_HEADER, baseline_bootstrap, baseline_cluster
from bench.harness import ProcessGroup, answers_chat, scrape, scrape_labelled
from bench.loadgen import Target
from bench.workload import ModelRole, RequestSpec
from poolgate.kernel.config import load_config
from poolgate.kernel.store import FleetStore, connect
from poolgate.procs import envoy_binary, free_port, wait_port
from poolgate.up import Stack, StackPorts

MODELS: dict[ModelRole, str] = {"chat": "llama-3.1-8b-instruct", "code": "qwen2.5-coder-7b"}
"""Served names that are not model-hub ids, so no router looks a tokenizer up on a hub."""
POOL_OF_ROLE: dict[ModelRole, str] = {"chat": "chat", "code": "code"}
POOL_MAX_MODEL_LEN = {"chat": 18432, "code": 4096}
KEY_PREFIX = "bench"


@dataclass(frozen=True)
class FleetLayout:
    name: str
    groups: tuple[tuple[str, str, int], ...]
    """(pool, preset, count) per group of identical workers."""
    prefill_pool: str | None = None
    """Disaggregated: this extra pool (``role: prefill``) prefills the chat model's long prompts and the
    chat pool decodes them (``role: decode``)."""
    min_prompt_tokens: int = 2048
    """``disaggregation.min_prompt_tokens`` of a disaggregated layout."""

    def describe(self) -> str:
        pools: dict[str, list[str]] = {}
        for pool, preset, count in self.groups:
            pools.setdefault(pool, []).append(f"{count} × {preset}")
        return "; ".join(f"{pool}: {' + '.join(parts)}" for pool, parts in pools.items())


LAYOUTS = {layout.name: layout for layout in (
    FleetLayout("heterogeneous", (("chat", "l4-24gb", 6), ("chat", "h100-80gb", 2), ("code", "h100-80gb", 1),
                                  ("code", "l4-24gb", 1))),
    FleetLayout("homogeneous", (("chat", "h100-80gb", 3), ("code", "h100-80gb", 1))),
)}


@dataclass(frozen=True)
class WorkerPlan:
    id: str
    pool: str
    preset: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_workers(layout: FleetLayout = LAYOUTS["heterogeneous"]) -> list[WorkerPlan]:
    plans: list[WorkerPlan] = []
    for pool, preset, count in layout.groups:
        for number in range(1, count + 1):
            short = "l4" if preset.startswith("l4") else "h100"
            plans.append(WorkerPlan(f"{pool}-{short}-{number}", pool, preset, free_port()))
    return plans


PREFILL_BACKLOG_S = 0.0
"""The benchmark's prefill-backlog gate (model seconds; 0 = off). Off: at 0.5 s it held requests on a stale
view of the engines' queues (waiting is scraped every 250 ms, placements settle after 500 ms) and raised
poolgate's TTFT p99 on the homogeneous fleet 1.7-6× above the peers' (sessions 1.58 s against 0.24-0.31 s)."""


def scaled_settings(time_scale: float) -> dict[str, dict[str, float]]:
    """poolgate's control-loop intervals and time bounds in wall seconds for engines running ``time_scale``
    times real speed (defaults ÷ time_scale; a rate × time_scale), so they stay the defaults in model time."""
    wall = 1.0 / time_scale
    return {
        "extproc": {"snapshot_refresh_s": 0.1 * wall, "stale_after_s": 3.0 * wall},
        # Generous TTL: a loaded 2-core host must not drop workers from Envoy between heartbeats.
        "controller": {"heartbeat_interval_s": 0.5 * wall, "heartbeat_ttl_s": 5.0 * wall},
        "agent": {"scrape_interval_s": 0.25 * wall},
        # A shared 2-core host can starve a simulated worker of CPU for seconds under a saturating sweep:
        # a bench worker is judged slowly and never replaced, so no run loses a worker to the host's load.
        "health": {"probe_interval_s": 0.5 * wall, "probe_timeout_s": 5.0 * wall,
                   "replace_failed_after_s": 600.0, "kv_leak_after_s": 600.0},
        "scheduling": {"max_wait_s": 5.0 * wall, "ttft_reference_s": 0.5 * wall,
                       "reservation_settle_s": 0.5 * wall, "default_prefill_tokens_per_s": 8000.0 * time_scale,
                       **({"max_prefill_backlog_s": PREFILL_BACKLOG_S * wall} if PREFILL_BACKLOG_S else {})},
    }


def fleet_config(workers: list[WorkerPlan], time_scale: float,
                 layout: FleetLayout | None = None, extproc_processes: int | None = None) -> dict[str, object]:
    """The poolgate config of the benchmark (YAML-shaped); ``extproc_processes`` None: the default (one per
    core)."""
    settings = scaled_settings(time_scale)
    if extproc_processes is not None:
        settings["extproc"]["processes"] = extproc_processes
    pools: list[dict[str, object]] = [{"name": pool, "model": MODELS[role], "max_model_len": POOL_MAX_MODEL_LEN[pool]}
                                      for role, pool in POOL_OF_ROLE.items()]
    split: dict[str, object] = {}
    if layout is not None and layout.prefill_pool is not None:
        chat = pools[0]
        chat["role"] = "decode"
        pools.append({**chat, "name": layout.prefill_pool, "role": "prefill"})
        split = {"disaggregation": {"min_prompt_tokens": layout.min_prompt_tokens}}
    return {
        "key_prefix": KEY_PREFIX,
        "ports": {"envoy": 0},
        **{section: values for section, values in settings.items() if section != "scheduling"},
        "scheduling": {"task_classes": {"code_models": [MODELS["code"]]}, **settings["scheduling"]},
        "pools": pools,
        **split,
        "workers": [{"id": w.id, "pool": w.pool, "backend": "sim", "preset": w.preset, "port": w.port,
                     "extra_args": ["--time-scale", repr(time_scale), "--log-level", "WARNING"]}
                    for w in workers],
    }


class BenchFleet:
    """Owns every process of the benchmark; ``stop`` always leaves none behind."""

    def __init__(self, run_dir: Path, time_scale: float, layout: FleetLayout = LAYOUTS["heterogeneous"],
                 extproc_processes: int | None = None) -> None:
        self.run_dir = run_dir
        self.time_scale = time_scale
        self.layout = layout
        self.workers = plan_workers(layout)
        self.baseline_port = free_port()
        self.baseline = ProcessGroup(run_dir)
        self.helpers = ProcessGroup(run_dir)
        """A separate agent, when the controller runs none."""
        self.baseline_weights: dict[str, int] = {}
        config_path = run_dir / "poolgate.yaml"
        config_path.write_text(yaml.safe_dump(fleet_config(self.workers, time_scale, layout, extproc_processes),
                                              sort_keys=False))
        self.config = load_config(config_path)
        processes = self.config.extproc.process_count()
        ports = replace(StackPorts.all_free(processes), extproc_metrics=tuple(free_port() for _ in range(processes)))
        if layout.prefill_pool is not None:
            ports = replace(ports, pd_sidecar=free_port())
        self.stack = Stack(self.config, config_path, run_dir, ports, None, "127.0.0.1")

    def pool_workers(self, pool: str) -> list[WorkerPlan]:
        return [w for w in self.workers if w.pool == pool]

    async def start(self, session: aiohttp.ClientSession) -> None:
        await self.stack.start()
        self.start_baseline({})
        if not await wait_port("127.0.0.1", self.baseline_port, 30):
            raise RuntimeError(f"the baseline Envoy did not start (log in {self.run_dir})")
        await self.stack.wait_until_serving()

    def start_baseline(self, weights: Mapping[str, int]) -> None:
        """(Re)start the baseline Envoy; ``weights`` (worker id → Envoy load-balancing weight) feed the
        weighted clusters, missing ids weigh 1."""
        self.baseline.stop_all()
        self.baseline_weights = dict(weights)
        pools: dict[str, list[tuple[str, int, int]]] = {}
        for worker in self.workers:
            pools.setdefault(worker.pool, []).append(("127.0.0.1", worker.port, weights.get(worker.id, 1)))
        bootstrap_path = self.run_dir / "envoy-baseline.yaml"
        bootstrap_path.write_text(yaml.safe_dump(baseline_bootstrap(pools, listen_port=self.baseline_port,
                                                                     admin_port=free_port())))
        self.baseline.start("envoy-baseline", [str(envoy_binary()), "-c", str(bootstrap_path), "-l", "warning",
                                               "--use-dynamic-base-id", "--disable-hot-restart"])

    async def restart_baseline(self, session: aiohttp.ClientSession, weights: Mapping[str, int]) -> None:
        self.start_baseline(weights)
        if not await wait_port("127.0.0.1", self.baseline_port, 30):
            raise RuntimeError(f"the baseline Envoy did not restart (log in {self.run_dir})")
        await self.check_baseline(session)

    async def restart_extproc(self, session: aiohttp.ClientSession) -> None:
        """Fresh extproc processes (no affinity map, no learned output lengths, no pending prefixes), as every
        peer router starts fresh: all of them, since one kept from the previous run would carry what it
        learned on another scenario into this one."""
        children = [c for c in self.stack.children if c.name == "extproc" or c.name.startswith("extproc-")]
        await asyncio.gather(*(self.stack.stop_child(child, grace_s=10.0) for child in children))
        for child in children:
            await self.stack.restart(child)
        for child, port in zip(children, self.stack.ports.extproc, strict=True):
            if not await wait_port("127.0.0.1", port, 30):
                raise RuntimeError(f"{child.name} did not come back (log: {child.log_path})")
        await self.stack.wait_until_serving()
        await self.wait_kv_events_in_sync(session)

    async def wait_kv_events_in_sync(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        """Until every extproc process follows every worker's KV events (its metrics say so): a process that
        just started places blind for its first second otherwise, and a router's run must not begin with
        what no deployment running for longer than that sees."""
        expected = len(self.workers)
        deadline = time.monotonic() + timeout_s
        for port in self.stack.ports.extproc_metrics:
            while True:
                try:
                    samples = await scrape_labelled(session, f"http://127.0.0.1:{port}")
                except (aiohttp.ClientError, OSError):
                    samples = {}
                if samples.get('poolgate_extproc_kv_event_streams{state="known"}', 0.0) >= expected:
                    break
                if time.monotonic() > deadline:
                    print(f"warning: extproc (metrics port {port}) not in sync with every worker's KV events after "
                          f"{timeout_s:.0f} s; the run goes on (logs in {self.run_dir})", file=sys.stderr, flush=True)
                    return
                await asyncio.sleep(0.1)

    async def reset_prefix_caches(self, session: aiohttp.ClientSession) -> None:
        """vLLM's ``POST /reset_prefix_cache`` on every worker (call it on an idle fleet)."""
        async def reset(worker: WorkerPlan) -> None:
            async with session.post(worker.url + "/reset_prefix_cache") as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{worker.id}: /reset_prefix_cache answered {response.status}")
        await asyncio.gather(*(reset(w) for w in self.workers))

    async def stop(self) -> None:
        self.baseline.stop_all()
        self.helpers.stop_all()
        await self.stack.stop()

    def target(self, policy: str) -> Target:
        """poolgate, or an Envoy baseline cluster (``baseline_envoy.LB_POLICIES``)."""
        if policy == "poolgate":
            return Target.single(policy, f"http://127.0.0.1:{self.stack.ports.envoy}")

        def headers(spec: RequestSpec) -> Mapping[str, str]:
            return {BENCH_CLUSTER_HEADER: baseline_cluster(POOL_OF_ROLE[spec.role], policy)}
        return Target.single(policy, f"http://127.0.0.1:{self.baseline_port}", headers)

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
        redis = connect(self.stack.redis_url, max_connections=None)
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
        self.helpers.start("agent", [sys.executable, "-m", "poolgate.cli", "agent", "--config",
                                      str(self.stack.config_path), "--redis-url", self.stack.redis_url,
                                      "--log-level", "WARNING"])
        if await self.wait_agent_data(wait_s):
            return "separate poolgate agent process"
        return "none (no live KV data in Redis)"

    async def check_baseline(self, session: aiohttp.ClientSession) -> None:
        """One tiny request per pool through the baseline Envoy."""
        for role, model in MODELS.items():
            cluster = baseline_cluster(POOL_OF_ROLE[role], "least_request")
            status = await answers_chat(session, f"http://127.0.0.1:{self.baseline_port}", model,
                                        {BENCH_CLUSTER_HEADER: cluster})
            if status != 200:
                raise RuntimeError(f"baseline Envoy answered {status} for {model}")
