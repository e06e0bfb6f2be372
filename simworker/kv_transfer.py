"""vLLM's KV-transfer roles (``--kv-transfer-config``): prefill workers hand their KV to decode workers.

The protocol, as vLLM's ``NixlConnector`` speaks it and the proxies that drive it (vLLM's disaggregated
serving proxy, llm-d's routing sidecar) use it:

1. The proxy sends the prefill worker the client's request with ``max_tokens: 1``, ``stream: false``, no
   ``stream_options`` and ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``.
2. The prefill worker computes the prompt's KV, samples one token and answers as usual plus
   ``kv_transfer_params: {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id",
   "remote_request_id", "remote_block_ids", "remote_host", "remote_port", "tp_size"}``. It keeps those
   blocks until a decode worker has read them, or until ``abort_timeout_s`` passes
   (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), then frees them.
3. The proxy sends a decode worker the client's request unchanged but for those ``kv_transfer_params``. The
   decode worker reads the blocks from the producer (NIXL over NVLink or RDMA; here a claim on the
   producer's HTTP port, then ``bytes / link bandwidth`` of waiting), tells the producer it is done, and
   decodes from the first token without prefilling. Params that expired or never existed are refused.

This module is the pure part (no I/O, no clock): the flag's fields, what a producer holds, and the
transfer's cost. ``kv_transfer_http`` does the claims over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from poolgate.kernel.errors import Refused
from simworker.json_flag import json_object

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES: tuple[KVRole, ...] = ("kv_producer", "kv_consumer", "kv_both")

NVLINK_GB_PER_S = 450.0
"""H100 NVLink 4, one direction (900 GB/s both ways): a prefill and a decode GPU in one node."""
RDMA_GB_PER_S = 50.0
"""Two 200 Gb/s InfiniBand or RoCE NICs per GPU pair across nodes; the simulator's default link."""
DEFAULT_ABORT_TIMEOUT_S = 480.0
"""vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``: a producer frees blocks nobody read after this long."""
TRANSFER_SETUP_S = 0.0005
"""A read's fixed cost (descriptor exchange, notification), whatever its size."""


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` fields the simulator reads; its own knobs live in
    ``kv_connector_extra_config`` as ``sim_link_gb_per_s`` and ``sim_abort_timeout_s``."""

    kv_connector: str
    kv_role: KVRole
    engine_id: str | None = None
    """Default: the worker's id (vLLM draws a uuid)."""
    link_gb_per_s: float = RDMA_GB_PER_S
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse the flag's JSON; ValueError names the field that is wrong."""
        raw = json_object("--kv-transfer-config", text)
        connector, role = raw.get("kv_connector"), raw.get("kv_role")
        if not isinstance(connector, str) or not connector:
            raise ValueError("--kv-transfer-config: 'kv_connector' must name a connector, e.g. NixlConnector")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config: 'kv_role' must be one of {', '.join(ROLES)}, got {role!r}")
        engine_id = raw.get("engine_id")
        if engine_id is not None and not isinstance(engine_id, str):
            raise ValueError("--kv-transfer-config: 'engine_id' must be a string")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: 'kv_connector_extra_config' must be an object")
        link = _positive(extra, "sim_link_gb_per_s", RDMA_GB_PER_S)
        timeout = _positive(extra, "sim_abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S)
        return cls(connector, role, engine_id, link, timeout)


def _positive(extra: dict[str, object], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{name} must be a number > 0")
    return float(value)


def transfer_seconds(tokens: int, kv_bytes_per_token: int, link_gb_per_s: float) -> float:
    """Reading ``tokens`` of KV over the link: ``setup + tokens × bytes per token / bandwidth``."""
    return TRANSFER_SETUP_S + tokens * kv_bytes_per_token / (link_gb_per_s * 1e9)


@dataclass(frozen=True)
class RemoteDecodeAsk:
    """Step 1: the request asks this (producer) worker to prefill for a decode elsewhere."""


@dataclass(frozen=True)
class RemotePrefill:
    """Step 3: the request carries a producer's params; its KV must be read, not computed."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


class TransferParamsError(Refused, ValueError):
    """``kv_transfer_params`` that no step of the protocol can use (400)."""


def read_params(body: object) -> RemoteDecodeAsk | RemotePrefill | None:
    """What a request's ``kv_transfer_params`` ask; None when it carries none (a plain request)."""
    if not isinstance(body, dict):
        return None
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TransferParamsError("'kv_transfer_params' must be an object")
    if params.get("do_remote_decode") is True:
        return RemoteDecodeAsk()
    if params.get("do_remote_prefill") is not True:
        return None
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    blocks, host, port = params.get("remote_block_ids"), params.get("remote_host"), params.get("remote_port")
    if not isinstance(engine_id, str) or not isinstance(request_id, str):
        raise TransferParamsError("kv_transfer_params: 'remote_engine_id' and 'remote_request_id' must be strings")
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise TransferParamsError("kv_transfer_params: 'remote_block_ids' must be a list of block ids")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        raise TransferParamsError("kv_transfer_params: 'remote_host' and 'remote_port' must name the producer")
    return RemotePrefill(engine_id, request_id, tuple(blocks), host, port)


@dataclass(frozen=True)
class HeldKV:
    """A finished prefill's blocks, kept for a decode worker to read."""

    request_id: str
    tokens: int
    block_ids: tuple[int, ...]
    expires_at: float


ClaimRefusal = Literal["unknown", "expired", "wrong_blocks"]


class ProducerBlocks:
    """What a producer holds for decode workers, keyed by its request id; pure, the caller passes ``now``.

    A claim starts a read and ``done`` ends it: the blocks are freed then, as a NIXL producer frees them on
    the consumer's notification. A reader that dies mid-read never says ``done``; another decode worker may
    then read the same blocks again until they expire (so a retried decode re-fetches the KV). Once read to
    the end, or past the timeout, the params are refused as ``unknown`` or ``expired``.
    """

    def __init__(self, block_size: int, abort_timeout_s: float) -> None:
        self.block_size = block_size
        self.abort_timeout_s = abort_timeout_s
        self._held: dict[str, HeldKV] = {}
        self._expired: set[str] = set()
        self._next_block = 0

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, tokens: int, now: float) -> HeldKV:
        self.expire(now)
        count = -(-tokens // self.block_size)
        blocks = tuple(range(self._next_block, self._next_block + count))
        self._next_block += count
        held = HeldKV(request_id, tokens, blocks, now + self.abort_timeout_s)
        self._held[request_id] = held
        return held

    def claim(self, request_id: str, block_ids: tuple[int, ...], now: float) -> HeldKV | ClaimRefusal:
        self.expire(now)
        held = self._held.get(request_id)
        if held is None:
            return "expired" if request_id in self._expired else "unknown"
        if block_ids != held.block_ids:
            return "wrong_blocks"
        return held

    def done(self, request_id: str) -> bool:
        """A reader finished: the blocks are freed; False if they were not held."""
        return self._held.pop(request_id, None) is not None

    def expire(self, now: float) -> int:
        """Free what nobody finished reading in time; the ids are remembered as expired."""
        gone = [rid for rid, held in self._held.items() if held.expires_at <= now]
        for request_id in gone:
            del self._held[request_id]
            self._expired.add(request_id)
        if len(self._expired) > 100_000:
            self._expired.clear()
        return len(gone)

    def params(self, held: HeldKV, engine_id: str, host: str, port: int) -> dict[str, object]:
        """The ``kv_transfer_params`` of the prefill's answer, the fields vLLM's NixlConnector returns."""
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": held.request_id, "remote_block_ids": list(held.block_ids),
            "remote_host": host, "remote_port": port, "tp_size": 1,
        }
