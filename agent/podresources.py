"""Which GPUs each pod on this node holds, from the kubelet's PodResources API.

The kubelet serves ``v1.PodResourcesLister`` on a unix socket of its node. ``List`` answers every pod on the
node with its containers' devices by resource name; for ``nvidia.com/gpu`` the device ids are GPU UUIDs
(``GPU-…``), the names NVML reports, so the agent can attribute a GPU's memory and utilisation to the worker
pod that holds it. A worker pod needs no ``CUDA_VISIBLE_DEVICES`` bookkeeping of its own.

``pod_gpus`` (pure) reads a reply; ``PodResourcesClient`` is the thin gRPC adapter around it.
"""

from __future__ import annotations

import grpc

from agent.kubelet.podresources_pb2 import ListPodResourcesRequest, ListPodResourcesResponse
from poolgate.kernel.errors import UpstreamError

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""Where the kubelet serves the API (``--pod-resources-socket`` changes it)."""

LIST_METHOD = "/v1.PodResourcesLister/List"

GPU_RESOURCES = frozenset({"nvidia.com/gpu", "nvidia.com/gpu.shared"})
"""Resource names of whole NVIDIA GPUs (``.shared``: the device plugin's time-slicing with renamed resources)."""

MAX_REPLY_BYTES = 16 * 1024 * 1024
"""The kubelet's own clients accept replies this large (a node with many pods and devices)."""

PodKey = tuple[str, str]
"""(namespace, pod name)"""


class PodResourcesError(UpstreamError):
    """The kubelet's PodResources API did not answer."""


def device_uuid(device_id: str) -> str:
    """The GPU behind a device id: a time-sliced replica (``GPU-…::2``) is the GPU it shares."""
    return device_id.split("::", 1)[0]


def pod_gpus(reply: ListPodResourcesResponse) -> dict[PodKey, tuple[str, ...]]:
    """GPU ids each pod holds over all its containers, in the kubelet's order, each GPU once; pods without
    GPUs are left out."""
    out: dict[PodKey, tuple[str, ...]] = {}
    for pod in reply.pod_resources:
        gpus: dict[str, None] = {}  # an ordered set
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name in GPU_RESOURCES:
                    gpus.update(dict.fromkeys(device_uuid(d) for d in devices.device_ids))
        if gpus:
            out[(pod.namespace, pod.name)] = tuple(gpus)
    return out


class PodResourcesClient:
    """``List`` over the kubelet's unix socket. Create it inside the running event loop."""

    def __init__(self, socket_path: str = POD_RESOURCES_SOCKET, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(
            f"unix://{socket_path}", options=[("grpc.max_receive_message_length", MAX_REPLY_BYTES)])
        self._list = self._channel.unary_unary(
            LIST_METHOD, request_serializer=ListPodResourcesRequest.SerializeToString,
            response_deserializer=ListPodResourcesResponse.FromString)

    async def pod_gpus(self) -> dict[PodKey, tuple[str, ...]]:
        try:
            reply = await self._list(ListPodResourcesRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise PodResourcesError(f"{exc.code().name}: {exc.details()}") from exc
        return pod_gpus(reply)

    async def close(self) -> None:
        await self._channel.close()
