"""Reading a PodResources ``List`` reply into GPU ids per pod (pure; the gRPC side is in tests/integration)."""

from __future__ import annotations

import pytest

from agent.kubelet.podresources_pb2 import (
    ContainerDevices,
    ContainerResources,
    ListPodResourcesResponse,
    PodResources,
)
from agent.podresources import device_uuid, pod_gpus


def pod(name: str, *containers: list[tuple[str, list[str]]], namespace: str = "poolgate") -> PodResources:
    return PodResources(name=name, namespace=namespace, containers=[
        ContainerResources(name=f"c{i}", devices=[ContainerDevices(resource_name=resource, device_ids=ids)
                                                  for resource, ids in devices])
        for i, devices in enumerate(containers)])


def test_gpus_per_pod_across_containers_in_kubelet_order() -> None:
    reply = ListPodResourcesResponse(pod_resources=[
        pod("worker-a", [("nvidia.com/gpu", ["GPU-2222", "GPU-1111"])], [("nvidia.com/gpu", ["GPU-3333"])]),
        pod("worker-a", [("nvidia.com/gpu", ["GPU-4444"])], namespace="other"),
        pod("sidecar-only", [("example.com/nic", ["eth7"])]),
        pod("no-devices", []),
    ])
    assert pod_gpus(reply) == {("poolgate", "worker-a"): ("GPU-2222", "GPU-1111", "GPU-3333"),
                               ("other", "worker-a"): ("GPU-4444",)}


def test_only_whole_gpu_resources_count() -> None:
    reply = ListPodResourcesResponse(pod_resources=[
        pod("w", [("nvidia.com/gpu", ["GPU-1"]), ("nvidia.com/mig-1g.10gb", ["MIG-9"]),
                  ("example.com/fpga", ["fpga0"]), ("nvidia.com/gpu.shared", ["GPU-2::0"])]),
    ])
    assert pod_gpus(reply) == {("poolgate", "w"): ("GPU-1", "GPU-2")}


@pytest.mark.parametrize(("device_id", "uuid"), [
    ("GPU-8f3c", "GPU-8f3c"),
    ("GPU-8f3c::3", "GPU-8f3c"),  # a time-sliced replica is the GPU it shares
    ("0", "0"),
])
def test_device_uuid(device_id: str, uuid: str) -> None:
    assert device_uuid(device_id) == uuid


def test_replicas_of_one_gpu_count_once() -> None:
    reply = ListPodResourcesResponse(pod_resources=[
        pod("w", [("nvidia.com/gpu", ["GPU-1::0", "GPU-1::1", "GPU-2::0"])]),
    ])
    assert pod_gpus(reply) == {("poolgate", "w"): ("GPU-1", "GPU-2")}


def test_an_empty_node() -> None:
    assert pod_gpus(ListPodResourcesResponse()) == {}
