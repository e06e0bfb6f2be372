"""Keeps configured LoRA adapters loaded on the workers of their base model (the lease holder only).

Design: reconcile, do not react per request. Every ``catalogue.adapter_sync_s`` the loader reads the
registry and, for each configured adapter with a ``path``, asks each Ready or Busy worker of the base
model's ``/v1/models`` whether it holds the adapter and loads it through ``/v1/load_lora_adapter`` when not.
So an adapter is on every worker that has room before a request for it arrives, and comes back on its
own after a worker restarts (vLLM forgets runtime-loaded adapters).

Why not load on demand: the router sees adapters only while requests use them
(``vllm:lora_requests_info``), never an idle loaded one, so "this worker lacks the adapter" is not
knowable on the request path; holding a request until a load finishes would also tie the request path
to the controller. The cost of this choice: a worker whose slots are all taken by other adapters stays
without it (its load is refused) and a request sent there gets the worker's 404; the scheduler's
``lora-room`` filter and ``lora_affinity`` scorer steer requests away from full workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp

from controller.periodic import every
from poolgate.kernel.config import LoraAdapter
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore

log = logging.getLogger(__name__)

SERVING = frozenset((WorkerState.READY, WorkerState.BUSY))
REQUEST_TIMEOUT_S = 30.0
"""A load reads adapter weights from disk; allow it more than a probe."""


class AdapterLoader:
    def __init__(self, adapters: Sequence[LoraAdapter], store: FleetStore,
                 session: aiohttp.ClientSession, is_leader: Callable[[], bool], scheme: str = "http") -> None:
        self.adapters = tuple(a for a in adapters if a.path)
        self._store = store
        self._session = session
        self._scheme = scheme
        self._is_leader = is_leader
        self._no_runtime_loading: set[str] = set()
        """Workers that answered 404 to a load (runtime loading off); logged once each."""

    async def sync_once(self) -> list[tuple[str, str]]:
        """Load what is missing; returns the (worker id, adapter) pairs loaded by this pass."""
        if not self.adapters or not self._is_leader():
            return []
        workers = [w for w in await self._store.read_fleet() if w.state in SERVING]
        loaded: list[tuple[str, str]] = []
        for worker in workers:
            wanted = [a for a in self.adapters if a.base in worker.names]
            if not wanted:
                continue
            present = await self._loaded_on(worker)
            if present is None:
                continue
            for adapter in wanted:
                if adapter.name not in present and await self._load(worker, adapter):
                    loaded.append((worker.id, adapter.name))
        return loaded

    async def _loaded_on(self, worker: WorkerRecord) -> set[str] | None:
        try:
            async with self._session.get(f"{self._scheme}://{worker.address}/v1/models",
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
                if response.status != 200:
                    return None
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("cannot list models of %s: %s", worker.id, exc)
            return None
        cards = body.get("data") if isinstance(body, dict) else None
        return {card["id"] for card in cards or () if isinstance(card, dict) and isinstance(card.get("id"), str)}

    async def _load(self, worker: WorkerRecord, adapter: LoraAdapter) -> bool:
        try:
            async with self._session.post(f"{self._scheme}://{worker.address}/v1/load_lora_adapter",
                                          json={"lora_name": adapter.name, "lora_path": adapter.path},
                                          timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
                detail = (await response.text())[:200]
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("loading adapter %s on %s failed: %s", adapter.name, worker.id, exc)
            return False
        if status == 200:
            log.info("loaded adapter %s on %s", adapter.name, worker.id)
            return True
        if status == 404:
            if worker.id not in self._no_runtime_loading:
                self._no_runtime_loading.add(worker.id)
                log.warning("worker %s does not load adapters at run time (start vLLM with --enable-lora and "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", worker.id)
            return False
        log.info("worker %s refused adapter %s (%d): %s", worker.id, adapter.name, status, detail)
        return False


async def run_adapter_loader(loader: AdapterLoader, interval_s: float, stop: asyncio.Event) -> None:
    """Reconcile every ``interval_s`` until ``stop``; Redis or a worker away only delays the next pass."""
    await every(interval_s, stop, loader.sync_once, lambda exc: log.warning("adapter sync skipped: %s", exc))
