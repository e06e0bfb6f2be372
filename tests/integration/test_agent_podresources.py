"""The agent on a Kubernetes node: it learns which GPUs each worker pod holds from the kubelet's PodResources
API over a unix socket. There is no kubelet here: ``StandInKubelet`` is a real gRPC server on a unix socket
that implements ``v1.PodResourcesLister/List`` with pods the test sets."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from agent.agent import Agent, run_agent
from agent.gpu_sources.nvml import NvmlSource
from agent.gpus import GpuReader, GpuSample
from agent.kubelet.podresources_pb2 import (
    ContainerDevices,
    ContainerResources,
    ListPodResourcesRequest,
    ListPodResourcesResponse,
    PodResources,
)
from agent.podresources import PodResourcesClient, PodResourcesError
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from tests.manual_clock import ManualClock

CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m"}],
    "kubernetes": {"namespace": "inference"},
    "agent": {"scrape_interval_s": 0.05},
})
KEYS = RedisKeys("podres-test")
GPU_A = GpuSample(0, "GPU-aaaa", 81920.0, 70000.0, 11920.0, 0.1)
GPU_B = GpuSample(1, "GPU-bbbb", 81920.0, 20000.0, 61920.0, 0.9)
PAGE = ('vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:cache_config_info{block_size="16",engine="0",model_name="m",num_gpu_blocks="100"} 1.0\n')


def gpu_pod(name: str, *gpus: str, namespace: str = "inference") -> PodResources:
    return PodResources(name=name, namespace=namespace, containers=[
        ContainerResources(name="vllm", devices=[ContainerDevices(resource_name="nvidia.com/gpu", device_ids=gpus)])])


class StandInKubelet:
    """Serves ``v1.PodResourcesLister/List`` on a unix socket with the pods in ``self.pods``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: list[PodResources] = []
        self.calls = 0
        self._server: grpc.aio.Server | None = None

    async def _list(self, request: ListPodResourcesRequest,
                    context: grpc.aio.ServicerContext) -> ListPodResourcesResponse:
        self.calls += 1
        return ListPodResourcesResponse(pod_resources=self.pods)

    async def start(self) -> None:
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, request_deserializer=ListPodResourcesRequest.FromString,
                response_serializer=ListPodResourcesResponse.SerializeToString)})
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None


@pytest.fixture()
def socket_dir() -> Iterator[Path]:
    # A short path: unix socket paths are limited to about 100 bytes.
    path = Path(tempfile.mkdtemp(prefix="kubelet-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
async def kubelet(socket_dir: Path) -> AsyncIterator[StandInKubelet]:
    stand_in = StandInKubelet(str(socket_dir / "kubelet.sock"))
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


class Pages:
    """``/metrics`` by worker address; records which workers were scraped."""

    def __init__(self) -> None:
        self.fetched: list[str] = []

    async def fetch(self, host: str, port: int) -> str:
        self.fetched.append(host)
        return PAGE


class StaticGpus:
    """Stands in for NVML on a node with GPUs (none here)."""

    def read(self) -> dict[int, GpuSample]:
        return {GPU_A.index: GPU_A, GPU_B.index: GPU_B}

    def close(self) -> None:
        pass


async def register(redis_client: aioredis.Redis, worker_id: str, host: str, node: str) -> None:
    record = WorkerRecord(id=worker_id, pool="chat", model="m", host=host, port=8000, node=node)
    await FleetStore(redis_client, KEYS.prefix).register(record, ttl_s=10.0)


async def fleet(redis_client: aioredis.Redis) -> dict[str, WorkerRecord]:
    return {r.id: r for r in await FleetStore(redis_client, KEYS.prefix).read_fleet()}


async def test_client_lists_gpus_per_pod(kubelet: StandInKubelet) -> None:
    kubelet.pods = [gpu_pod("pg-chat-1", "GPU-bbbb"), gpu_pod("other-app", "GPU-aaaa", namespace="default")]
    client = PodResourcesClient(kubelet.socket_path)
    try:
        assert await client.pod_gpus() == {("inference", "pg-chat-1"): ("GPU-bbbb",),
                                           ("default", "other-app"): ("GPU-aaaa",)}
    finally:
        await client.close()


async def test_client_raises_its_own_error_when_the_kubelet_is_away(socket_dir: Path) -> None:
    client = PodResourcesClient(str(socket_dir / "absent.sock"), timeout_s=0.5)
    try:
        with pytest.raises(PodResourcesError):
            await client.pod_gpus()
    finally:
        await client.close()


async def test_agent_on_a_node_attributes_each_pods_gpus(redis_client: aioredis.Redis, kubelet: StandInKubelet) -> None:
    await register(redis_client, "pg-chat-1", "10.42.0.7", node="gpu-a")
    await register(redis_client, "pg-chat-2", "10.42.0.8", node="gpu-a")
    await register(redis_client, "pg-chat-3", "10.42.1.9", node="gpu-b")
    kubelet.pods = [gpu_pod("pg-chat-1", "GPU-bbbb"), gpu_pod("pg-chat-2", "GPU-aaaa"),
                    gpu_pod("pg-chat-1", "GPU-aaaa", namespace="elsewhere")]  # same name, not ours
    pages, clock = Pages(), ManualClock(1000.0)
    client = PodResourcesClient(kubelet.socket_path, timeout_s=0.5)
    gpus = NvmlSource(StaticGpus())  # type: ignore[arg-type]
    agent = Agent(FleetStore(redis_client, KEYS.prefix), pages, gpus, node="gpu-a", pod_gpus=client,
                  pod_namespace=CONFIG.kubernetes.namespace, clock=clock, fleet_refresh_s=2.0)
    try:
        await agent.tick()
        assert sorted(pages.fetched) == ["10.42.0.7", "10.42.0.8"]
        workers = await fleet(redis_client)
        first, second = workers["pg-chat-1"], workers["pg-chat-2"]
        assert (first.gpu_memory_free_mib, first.gpu_utilization) == (20000.0, 0.9)
        assert (second.gpu_memory_free_mib, second.gpu_utilization) == (70000.0, 0.1)
        assert workers["pg-chat-3"].metrics_at == 0.0  # another node's agent serves it

        # The kubelet going away costs nothing but fresh assignments: the last ones stay in use.
        await kubelet.stop()
        clock.now += 2.0  # the assignments are re-read with the fleet
        await agent.tick()
        assert agent.stats.pod_gpu_read_failures == 1
        assert (await fleet(redis_client))["pg-chat-1"].gpu_memory_free_mib == 20000.0
    finally:
        await client.close()


async def test_run_agent_with_a_node_uses_the_kubelet_socket(redis_client: aioredis.Redis,
                                                             kubelet: StandInKubelet) -> None:
    await register(redis_client, "pg-chat-1", "10.42.0.7", node="gpu-a")
    kubelet.pods = [gpu_pod("pg-chat-1", "GPU-bbbb")]

    def nvml(_: str) -> GpuReader:
        return StaticGpus()  # type: ignore[return-value]

    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(CONFIG, FleetStore(redis_client, KEYS.prefix), stop, node="gpu-a",
                                         source=Pages(), open_nvml=nvml, pod_resources_socket=kubelet.socket_path))
    try:
        for _ in range(100):
            if (await fleet(redis_client))["pg-chat-1"].gpu_memory_free_mib == 20000.0:
                break
            await asyncio.sleep(0.02)
        assert (await fleet(redis_client))["pg-chat-1"].gpu_memory_free_mib == 20000.0
        assert kubelet.calls >= 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)


async def test_run_agent_without_the_socket_still_serves_its_node(redis_client: aioredis.Redis,
                                                                 socket_dir: Path) -> None:
    await register(redis_client, "pg-chat-1", "10.42.0.7", node="gpu-a")
    pages = Pages()
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(CONFIG, FleetStore(redis_client, KEYS.prefix), stop, node="gpu-a",
                                         source=pages, open_nvml=lambda _: None,
                                         pod_resources_socket=str(socket_dir / "missing.sock")))
    try:
        for _ in range(100):
            if (await fleet(redis_client))["pg-chat-1"].running == 1:
                break
            await asyncio.sleep(0.02)
        assert (await fleet(redis_client))["pg-chat-1"].running == 1
        assert pages.fetched[0] == "10.42.0.7"
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)
