"""Kubernetes backend: one Deployment per pool (``{deployment_prefix}{pool}``), scaled through its Scale
subresource with the official ``kubernetes`` client.

Kubernetes places the pods (GPU requests, node selectors); the controller only sets replica counts:

- ``launch`` raises the replica count; ``stop`` first marks the drained pod with the lowest
  ``controller.kubernetes.io/pod-deletion-cost`` so the ReplicaSet removes *that* pod, then lowers it;
  ``restart`` deletes the pod and the Deployment starts a fresh one.
- ``sync_registry`` registers the pool's Ready pods (pod name = worker id, pod IP, the pool's port, the
  pod's node for that node's agent) and refreshes them every heartbeat; pods that go away simply expire.
  Workers therefore need no registration code of their own: the pod's readiness probe on ``/health``
  decides when it joins.

The client is synchronous (urllib3); calls run in a worker thread so the controller's loop never blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kubernetes import client as k8s

from poolgate.kernel.config import ControllerSettings, KubernetesSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.kubernetes")

POOL_LABEL = "poolgate.io/pool"
PORT_ANNOTATION = "poolgate.io/port"
KV_EVENTS_PORT_ANNOTATION = "poolgate.io/kv-events-port"
"""The port of the pod's KV-event PUB socket (``--kv-events-config`` endpoint ``tcp://*:PORT``)."""
KV_EVENTS_REPLAY_PORT_ANNOTATION = "poolgate.io/kv-events-replay-port"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_WORKER_PORT = 8000


def api_client_from_environment() -> k8s.ApiClient:
    """In a pod: the service account; elsewhere: the kubeconfig."""
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    return k8s.ApiClient()


def _ready(pod: Any) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


class KubernetesBackend:
    """The pools' Deployments; with a ``store``, also the registrant of their Ready pods (``ttl_s`` is the
    registration's life without a refresh, ``controller.heartbeat_ttl_s``)."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesSettings, pools: Sequence[PoolSpec], api: k8s.ApiClient,
                 store: FleetStore | None = None, ttl_s: float = ControllerSettings().heartbeat_ttl_s) -> None:
        self._settings = settings
        self._pools = tuple(pools)
        self._ttl_s = ttl_s
        self._apps = k8s.AppsV1Api(api)
        self._core = k8s.CoreV1Api(api)
        self._store = store
        self._pods: dict[str, str] = {}
        """Pod name → pool, from the last listing."""

    def deployment(self, pool: str) -> str:
        return f"{self._settings.deployment_prefix}{pool}"

    def owns(self, worker_id: str) -> bool:
        return worker_id in self._pods or worker_id.startswith(self._settings.deployment_prefix)

    async def _pods_of(self, pool: str) -> list[Any]:
        listing: Any = await asyncio.to_thread(self._core.list_namespaced_pod, self._settings.namespace,
                                               label_selector=f"{POOL_LABEL}={pool}")
        pods = [p for p in listing.items if p.metadata.deletion_timestamp is None]
        for pod in pods:
            self._pods[pod.metadata.name] = pool
        return pods

    async def pool_workers(self, pool: str) -> list[str]:
        return sorted(p.metadata.name for p in await self._pods_of(pool))

    async def replicas(self, pool: str) -> int:
        scale: Any = await asyncio.to_thread(self._apps.read_namespaced_deployment_scale, self.deployment(pool),
                                        self._settings.namespace)
        return int(scale.spec.replicas or 0)

    async def set_replicas(self, pool: str, replicas: int) -> None:
        await asyncio.to_thread(self._apps.patch_namespaced_deployment_scale, self.deployment(pool),
                                self._settings.namespace, {"spec": {"replicas": replicas}},
                                _content_type=MERGE_PATCH)
        log.info("deployment %s/%s: replicas %d", self._settings.namespace, self.deployment(pool), replicas)

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        await self.set_replicas(pool, await self.replicas(pool) + count)
        return []  # pod names are chosen by Kubernetes; they register when Ready

    async def stop(self, worker_id: str) -> None:
        pool = self._pods.get(worker_id)
        if pool is None:
            raise KeyError(f"pod {worker_id!r} is not a known worker pod")
        await asyncio.to_thread(self._core.patch_namespaced_pod, worker_id, self._settings.namespace,
                                {"metadata": {"annotations": {DELETION_COST: "-1000"}}}, _content_type=MERGE_PATCH)
        await self.set_replicas(pool, max(0, await self.replicas(pool) - 1))

    async def restart(self, worker_id: str) -> None:
        await asyncio.to_thread(self._core.delete_namespaced_pod, worker_id, self._settings.namespace)
        log.info("deleted pod %s for a fresh one", worker_id)

    async def sync_registry(self) -> int:
        """Register or refresh every Ready pod of every pool; returns how many are registered."""
        assert self._store is not None
        ttl = self._ttl_s
        count = 0
        for pool_spec in self._pools:
            for pod in await self._pods_of(pool_spec.name):
                if not _ready(pod) or not pod.status.pod_ip:
                    continue
                name = pod.metadata.name
                annotations = pod.metadata.annotations or {}
                node = (pod.spec.node_name if pod.spec else None) or ""
                # The node goes with every heartbeat too, so records written before it was kept get it.
                if not await self._store.heartbeat(name, ttl, node=node):
                    record = WorkerRecord(id=name, pool=pool_spec.name, model=pool_spec.model, host=pod.status.pod_ip,
                                          port=int(annotations.get(PORT_ANNOTATION, DEFAULT_WORKER_PORT)),
                                          max_model_len=pool_spec.max_model_len, backend="kubernetes", node=node,
                                          state=WorkerState.READY)
                    record = record.with_live(**_kv_events_endpoints(pod.status.pod_ip, annotations))
                    await self._store.register(record, ttl)
                count += 1
        return count


def _kv_events_endpoints(pod_ip: str, annotations: dict[str, str]) -> dict[str, str]:
    """Where the pod publishes its KV events, from its annotations (none: it publishes none)."""
    endpoints: dict[str, str] = {}
    for field, annotation in (("kv_events_endpoint", KV_EVENTS_PORT_ANNOTATION),
                              ("kv_events_replay_endpoint", KV_EVENTS_REPLAY_PORT_ANNOTATION)):
        port = annotations.get(annotation, "")
        if port.isdigit():
            endpoints[field] = f"tcp://{pod_ip}:{port}"
    return endpoints
