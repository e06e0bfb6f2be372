"""The routers compared, all in front of the same worker processes; each starts fresh for its run.

- ``poolgate``: the product path (Envoy → ext_proc → pinned worker); extproc is restarted before each run
  so it carries no affinity or latency history from the previous router's run.
- ``least_request``, ``least_request_weighted``, ``round_robin``: plain Envoy (``baseline_envoy``);
  the weighted one uses each worker's capacity measured during the capacity sweep.
- ``vllm-router:cache_aware``, ``vllm-router:power_of_two``, ``sglang-router:cache_aware``: the peers
  from PyPI, one router process per pool (each project routes one model per process in its regular mode),
  started from the benchmark's own venv and stopped after the run. Both cache-aware policies keep an
  approximate radix tree of the request text per worker and need no tokenizer; they run with the hub
  switched off (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``), a private ``HF_HOME`` and served names that
  are not hub ids, so nothing looks a tokenizer up on the network. Their intervals (cache-tree eviction)
  are divided by the time scale like poolgate's.
- ``oracle``: the prefix-cache hit rate's upper reference, not a product. For each request the benchmark
  asks every worker of the pool how many leading tokens of this very prompt its cache holds now (the
  simulator's ``POST /sim/cached_prefix``, counted as the engine counts a hit) and sends it straight to the
  one holding the most (ties: fewest waiting, then running requests). Asking the engines at the moment of
  the decision, rather than following their KV events, leaves no event delay, no missed eviction and no
  tokenisation of its own between the truth and the pick, so it is the ground truth poolgate's index is
  measured against. It knows nothing of requests placed but not yet scheduled, as no event-fed router does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from bench.harness import ProcessGroup, answers_chat
from bench.loadgen import Target
from bench.peer_install import PeerVenv
from bench.sched_fleet import MODELS, POOL_OF_ROLE, BenchFleet
from bench.workload import ModelRole, RequestSpec
from poolgate.procs import free_port

ENVOY_POLICIES = ("least_request", "least_request_weighted", "round_robin")
PEER_ROUTERS = ("vllm-router:cache_aware", "vllm-router:power_of_two", "sglang-router:cache_aware")
ORACLE = "oracle"
ALL_ROUTERS = ("poolgate", *ENVOY_POLICIES, *PEER_ROUTERS, ORACLE)
EVICTION_INTERVAL_S = {"vllm-router": 120.0, "sglang-router": 60.0}
"""The projects' default cache-tree eviction intervals (real time)."""
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
READY_TIMEOUT_S = 90.0


class Router(Protocol):
    name: str

    async def start(self, session: aiohttp.ClientSession) -> Target: ...

    async def stop(self) -> None: ...


@dataclass
class PoolgateRouter:
    fleet: BenchFleet
    name: str = "poolgate"

    async def start(self, session: aiohttp.ClientSession) -> Target:
        await self.fleet.restart_extproc(session)
        return self.fleet.target("poolgate")

    async def stop(self) -> None:
        return None


@dataclass
class EnvoyRouter:
    fleet: BenchFleet
    name: str

    async def start(self, session: aiohttp.ClientSession) -> Target:
        return self.fleet.target(self.name)

    async def stop(self) -> None:
        return None


def peer_command(venv: PeerVenv, project: str, policy: str, worker_urls: Sequence[str], port: int,
                 metrics_port: int, time_scale: float) -> list[str]:
    """The peer's command line (flags as its ``--help`` gives them)."""
    launcher = [str(venv.vllm_router)] if project == "vllm-router" else [
        str(venv.python), "-m", "sglang_router.launch_router"]
    return [*launcher, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--eviction-interval-secs", str(max(1, round(EVICTION_INTERVAL_S[project] / time_scale))),
            "--worker-startup-check-interval", "1", "--log-level", "warning" if project == "vllm-router" else "warn"]


class PeerRouter:
    """One peer process per pool the scenario uses; ``start`` returns once each answers a chat request."""

    def __init__(self, name: str, fleet: BenchFleet, venv: PeerVenv, roles: Sequence[ModelRole],
                 log_dir: Path) -> None:
        self.name = name
        self.project, self.policy = name.split(":")
        self.fleet = fleet
        self.venv = venv
        self.roles = tuple(roles)
        self.processes = ProcessGroup(log_dir)
        self.urls: dict[ModelRole, str] = {}

    async def start(self, session: aiohttp.ClientSession) -> Target:
        for role in self.roles:
            port = free_port()
            workers = [w.url for w in self.fleet.pool_workers(POOL_OF_ROLE[role])]
            command = peer_command(self.venv, self.project, self.policy, workers, port, free_port(),
                                   self.fleet.time_scale)
            env = {**OFFLINE_ENV, "HF_HOME": str(self.processes.log_dir / "hf-home"), "NO_COLOR": "1"}
            self.processes.start(f"{self.project}-{self.policy}-{role}", command, env)
            self.urls[role] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        for role, url in self.urls.items():
            while await answers_chat(session, url, MODELS[role]) != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} for {role} did not answer within {READY_TIMEOUT_S:.0f} s "
                                       f"(logs in {self.processes.log_dir})")
                await asyncio.sleep(0.5)
        urls = dict(self.urls)

        def url_of(spec: RequestSpec) -> str:
            return urls[spec.role]
        return Target(self.name, url_of)

    async def stop(self) -> None:
        await asyncio.to_thread(self.processes.stop_all)
        self.urls.clear()


class OracleRouter:
    """Sends each request to the worker whose cache holds its longest prefix (see the module docstring)."""

    def __init__(self, fleet: BenchFleet, name: str = ORACLE) -> None:
        self.name = name
        self.fleet = fleet

    async def start(self, session: aiohttp.ClientSession) -> Target:
        pools = {role: [w.url for w in self.fleet.pool_workers(pool)] for role, pool in POOL_OF_ROLE.items()}

        async def ask(url: str, body: bytes) -> tuple[int, int, int]:
            async with session.post(url + "/sim/cached_prefix", data=body,
                                    headers={"content-type": "application/json"}) as response:
                answer = await response.json() if response.status == 200 else {}
            return (int(answer.get("cached_tokens", 0)), -int(answer.get("waiting", 1 << 20)),
                    -int(answer.get("running", 1 << 20)))

        async def resolve(spec: RequestSpec, body: bytes) -> str:
            urls = pools[spec.role]
            facts = await asyncio.gather(*(ask(url, body) for url in urls))
            return max(zip(facts, urls, strict=True))[1]

        return Target(self.name, lambda spec: pools[spec.role][0], resolve=resolve)

    async def stop(self) -> None:
        return None


def make_router(name: str, fleet: BenchFleet, venv: PeerVenv | None, roles: Sequence[ModelRole],
                log_dir: Path) -> Router:
    if name == "poolgate":
        return PoolgateRouter(fleet)
    if name in ENVOY_POLICIES:
        return EnvoyRouter(fleet, name)
    if name == ORACLE:
        return OracleRouter(fleet)
    if name in PEER_ROUTERS:
        if venv is None:
            raise ValueError(f"{name} needs the peers' venv (run without --no-peers)")
        return PeerRouter(name, fleet, venv, roles, log_dir)
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ALL_ROUTERS)}")


def capacity_weights(generation_tokens: Mapping[str, int], pools: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Envoy weights from each worker's tokens generated at saturation: 100 for the fastest of its pool,
    the others in proportion (at least 1)."""
    weights: dict[str, int] = {}
    for ids in pools.values():
        top = max((generation_tokens.get(i, 0) for i in ids), default=0)
        for worker in ids:
            weights[worker] = max(1, round(100 * generation_tokens.get(worker, 0) / top)) if top else 1
    return weights
