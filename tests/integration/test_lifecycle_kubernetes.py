"""The Kubernetes backend against a fake API server that speaks the API's HTTP contract (paths, verbs,
patch content types, JSON shapes) — there is no cluster here. A real cluster is not exercised."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from kubernetes import client as k8s

from agent.agent import Agent
from controller.kube_backend import DELETION_COST, KubernetesBackend
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore

CONFIG = parse_config({"pools": [{"name": "chat", "model": "llama", "max_model_len": 4096}],
                       "kubernetes": {"namespace": "inference", "deployment_prefix": "pg-"}})


def pod(name: str, ready: bool, ip: str = "10.1.0.7", node: str = "gpu-node-1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "inference", "labels": {"poolgate.io/pool": "chat"},
                         "annotations": {"poolgate.io/port": "8000"}},
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeApi:
    def __init__(self) -> None:
        self.replicas = 2
        self.pods = {"pg-chat-a1": pod("pg-chat-a1", True),
                     "pg-chat-b2": pod("pg-chat-b2", False, "10.1.0.8", node="gpu-node-2")}
        self.calls: list[tuple[str, str, str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app

    def _scale(self) -> web.Response:
        return web.json_response({"apiVersion": "autoscaling/v1", "kind": "Scale",
                                  "metadata": {"name": "pg-chat", "namespace": "inference"},
                                  "spec": {"replicas": self.replicas}, "status": {"replicas": self.replicas}})

    async def handle(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read()) if request.can_read_body else None
        self.calls.append((request.method, request.path, request.content_type, body))
        path = request.path
        if path == "/apis/apps/v1/namespaces/inference/deployments/pg-chat/scale":
            if request.method == "PATCH":
                self.replicas = body["spec"]["replicas"]
            return self._scale()
        if path == "/api/v1/namespaces/inference/pods" and request.method == "GET":
            assert request.query["labelSelector"] == "poolgate.io/pool=chat"
            return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {},
                                      "items": list(self.pods.values())})
        if path.startswith("/api/v1/namespaces/inference/pods/"):
            name = path.rsplit("/", 1)[1]
            if request.method == "PATCH":
                self.pods[name]["metadata"]["annotations"].update(body["metadata"]["annotations"])
                return web.json_response(self.pods[name])
            if request.method == "DELETE":
                return web.json_response(self.pods.pop(name))
        return web.json_response({"kind": "Status", "code": 404}, status=404)


@pytest.fixture()
async def fake() -> AsyncIterator[tuple[FakeApi, k8s.ApiClient]]:
    api = FakeApi()
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{runner.addresses[0][1]}")
    client = k8s.ApiClient(configuration)
    yield api, client
    client.close()
    await runner.cleanup()


async def test_scale_up_stop_a_chosen_pod_and_restart(fake: tuple[FakeApi, k8s.ApiClient]) -> None:
    api, client = fake
    backend = KubernetesBackend(CONFIG.kubernetes, CONFIG.pools, client)
    assert await backend.pool_workers("chat") == ["pg-chat-a1", "pg-chat-b2"]
    assert backend.owns("pg-chat-a1") and not backend.owns("local-1")
    assert await backend.launch("chat", 2) == [] and api.replicas == 4
    patch = next(c for c in api.calls if c[0] == "PATCH")
    assert patch[2] == "application/merge-patch+json" and patch[3] == {"spec": {"replicas": 4}}
    await backend.stop("pg-chat-b2")
    # The drained pod is marked cheapest to delete before the count drops, so the ReplicaSet removes it.
    methods = [(c[0], c[1].rsplit("/", 1)[1]) for c in api.calls[-3:]]
    assert methods == [("PATCH", "pg-chat-b2"), ("GET", "scale"), ("PATCH", "scale")]
    assert api.pods["pg-chat-b2"]["metadata"]["annotations"][DELETION_COST] == "-1000"
    assert api.replicas == 3
    await backend.restart("pg-chat-a1")
    assert "pg-chat-a1" not in api.pods
    with pytest.raises(KeyError):
        await backend.stop("unknown-pod")


async def test_ready_pods_are_registered_as_workers(fake: tuple[FakeApi, k8s.ApiClient], redis_url: str) -> None:
    api, client = fake
    redis = aioredis.from_url(redis_url)
    store = FleetStore(redis, "k8s")
    backend = KubernetesBackend(CONFIG.kubernetes, CONFIG.pools, client, store)
    assert await backend.sync_registry() == 1
    [worker] = await store.read_fleet()
    assert (worker.id, worker.host, worker.port, worker.pool, worker.model, worker.node) == (
        "pg-chat-a1", "10.1.0.7", 8000, "chat", "llama", "gpu-node-1")
    api.pods["pg-chat-b2"]["status"]["conditions"][0]["status"] = "True"
    assert await backend.sync_registry() == 2
    assert sorted(w.id for w in await store.read_fleet()) == ["pg-chat-a1", "pg-chat-b2"]
    await redis.aclose()


async def test_a_record_written_without_a_node_gets_it_with_the_next_heartbeat(
        fake: tuple[FakeApi, k8s.ApiClient], redis_url: str) -> None:
    _, client = fake
    redis = aioredis.from_url(redis_url)
    store = FleetStore(redis, "k8s")
    # As an older controller wrote it: no node field at all.
    old = WorkerRecord(id="pg-chat-a1", pool="chat", model="llama", host="10.1.0.7", port=8000, backend="kubernetes")
    await store.register(old, ttl_s=30.0)
    await redis.hdel(store.keys.worker("pg-chat-a1"), "node")
    assert [w.node for w in await store.read_fleet()] == [""]
    assert await KubernetesBackend(CONFIG.kubernetes, CONFIG.pools, client, store).sync_registry() == 1
    assert [w.node for w in await store.read_fleet()] == ["gpu-node-1"]
    await redis.aclose()


class PagesByAddress:
    def __init__(self) -> None:
        self.fetched: list[str] = []

    async def fetch(self, host: str, port: int) -> str:
        self.fetched.append(f"{host}:{port}")
        return 'vllm:num_requests_running{engine="0",model_name="llama"} 2\n'


async def test_each_nodes_agent_serves_the_pods_on_its_node(fake: tuple[FakeApi, k8s.ApiClient],
                                                            redis_url: str) -> None:
    """Pods register their pod IPs, which are no address of any node; the node in their record is what lets
    each node's agent find its own."""
    api, client = fake
    api.pods["pg-chat-b2"]["status"]["conditions"][0]["status"] = "True"
    redis = aioredis.from_url(redis_url)
    store = FleetStore(redis, "k8s")
    assert await KubernetesBackend(CONFIG.kubernetes, CONFIG.pools, client, store).sync_registry() == 2
    scraped: dict[str, list[str]] = {}
    for node in ("gpu-node-1", "gpu-node-2", "cpu-node"):
        pages = PagesByAddress()
        await Agent(store, pages, node=node, local_names={"cpu-node", "10.0.0.1"}).tick()
        scraped[node] = pages.fetched
    assert scraped == {"gpu-node-1": ["10.1.0.7:8000"], "gpu-node-2": ["10.1.0.8:8000"], "cpu-node": []}
    assert [w.running for w in await store.read_fleet()] == [2, 2]
    await redis.aclose()
