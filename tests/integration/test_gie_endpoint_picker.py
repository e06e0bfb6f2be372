"""extproc as the endpoint picker of a Gateway API Inference Extension style gateway.

A real Envoy set up the way that protocol's reference gateway is: the route goes to one ``ORIGINAL_DST``
cluster that connects to the ``ip:port`` in the ``x-gateway-destination-endpoint`` request header, and the
ext_proc filter (headers + buffered body) talks to a real extproc reading a real Redis that holds simulated
workers. A second listener first sets the subset hint (``envoy.lb.subset_hint`` filter metadata) with a
``set_metadata`` filter and forwards that namespace to extproc, as a gateway restricting the pick would.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from extproc.endpoint_picker import SUBSET_KEY, SUBSET_NAMESPACE
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.routing import DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE, WORKER_HEADER
from poolgate.kernel.store import FleetStore
from poolgate.procs import envoy_binary, extproc_process, free_port, port_open, simworker_process, stop_process
from tests.run_dirs import run_directory

MODEL = "gie-model"
KEYS = RedisKeys("gie-it")
WORKER_IDS = ("gie-w1", "gie-w2", "gie-w3")
CONFIG_DATA: dict[str, Any] = {
    "pools": [{"name": "chat", "model": MODEL}],
    "key_prefix": KEYS.prefix,
    "extproc": {"endpoint_picker_mode": "gie", "stale_after_s": 60},
}


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, int]]:
    """Three simulated workers in one process: worker id → port."""
    ports = [free_port() for _ in WORKER_IDS]
    with simworker_process(ports, ["--worker-ids", *WORKER_IDS, "--model", MODEL, "--time-scale", "20",
                                   "--log-level", "WARNING"]):
        yield dict(zip(WORKER_IDS, ports, strict=True))


def _filters(extproc_port: int, subset: list[str] | None) -> list[dict[str, Any]]:
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "5s"},
            "failure_mode_allow": False,
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
            "allow_mode_override": True,
            "message_timeout": "5s",
            "mutation_rules": {"allow_all_routing": True},
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
                                 "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
        },
    }
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append({
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: subset}}],
            },
        })
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    return [*filters, ext_proc, router]


def _listener(name: str, port: int, extproc_port: int, subset: list[str] | None) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                         ".HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"virtual_hosts": [{
                    "name": "models", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "30s"}}],
                }]},
                "http_filters": _filters(extproc_port, subset),
            },
        }]}],
    }


def gie_bootstrap(port: int, subset_port: int, admin_port: int, extproc_port: int,
                  subset: list[str]) -> dict[str, Any]:
    """The reference gateway's shape: one ORIGINAL_DST cluster reading the picked endpoint from the header."""
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener("plain", port, extproc_port, None),
                          _listener("subset", subset_port, extproc_port, subset)],
            "clusters": [
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_ENDPOINT_KEY}},
                {"name": "epp", "type": "STATIC", "connect_timeout": "2s",
                 "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {
                     "address": {"socket_address": {"address": "127.0.0.1", "port_value": extproc_port}}}}]}]},
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}}},
            ],
        },
    }


class Gateway:
    def __init__(self, bootstrap: dict[str, Any], port: int, subset_port: int) -> None:
        self._log = (run_directory("poolgate-gie-") / "envoy.log").open("wb")
        self.proc = subprocess.Popen(
            [str(envoy_binary()), "--config-yaml", json.dumps(bootstrap), "--use-dynamic-base-id",
             "--disable-hot-restart", "-l", "warning", "--concurrency", "1"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        self.subset_url = f"http://127.0.0.1:{subset_port}"
        self.ports = (port, subset_port)

    def logs(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture()
async def fleet(redis_url: str, workers: dict[str, int]) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    for worker_id, port in workers.items():
        await FleetStore(client, KEYS.prefix).register(WorkerRecord(id=worker_id, pool="chat", model=MODEL,
                                                                    host="127.0.0.1", port=port), ttl_s=120.0)
    yield client
    await client.aclose()


@pytest.fixture()
def extproc(redis_url: str, fleet: aioredis.Redis, tmp_path: Path) -> Iterator[int]:
    """``poolgate extproc`` as its own process, as a gateway would run it."""
    config_file = tmp_path / "poolgate.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG_DATA))
    with extproc_process(config_file, redis_url) as (_, port):
        yield port


@pytest.fixture()
async def gateway(extproc: int, workers: dict[str, int]) -> AsyncIterator[Gateway]:
    port, subset_port, admin_port = free_port(), free_port(), free_port()
    subset = [f"127.0.0.1:{workers['gie-w2']}"]
    gw = Gateway(gie_bootstrap(port, subset_port, admin_port, extproc, subset), port, subset_port)
    try:
        deadline = time.monotonic() + 15
        while not all(port_open("127.0.0.1", p) for p in gw.ports):
            assert gw.proc.poll() is None, gw.logs()
            assert time.monotonic() < deadline, f"envoy did not listen\n{gw.logs()}"
            await asyncio.sleep(0.05)
        yield gw
    finally:
        gw.stop()


async def _complete(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, str | None, bytes]:
    body = {"model": MODEL, "prompt": "pick a worker for me", "max_tokens": 4}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        return response.status, response.headers.get(WORKER_HEADER), await response.read()


async def test_requests_land_on_a_picked_worker(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session:
        results = [await _complete(session, gateway.url) for _ in range(12)]
    assert all(status == 200 for status, _, _ in results), (results, gateway.logs())
    assert {worker for _, worker, _ in results} <= set(WORKER_IDS)


async def test_a_client_cannot_pin_itself(gateway: Gateway, workers: dict[str, int]) -> None:
    """extproc strips the client's copy and writes its own pick; restricted by a subset, only w2 may serve."""
    async with aiohttp.ClientSession() as session:
        results = [await _complete(session, gateway.subset_url,
                                   **{DESTINATION_ENDPOINT_KEY: f"127.0.0.1:{workers['gie-w1']}"})
                   for _ in range(8)]
    assert [worker for _, worker, _ in results] == ["gie-w2"] * 8, (results, gateway.logs())


async def test_the_subset_hint_restricts_the_pick(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session:
        results = [await _complete(session, gateway.subset_url) for _ in range(12)]
    assert [(status, worker) for status, worker, _ in results] == [(200, "gie-w2")] * 12, gateway.logs()


async def test_no_ready_worker_is_a_503_json(gateway: Gateway, fleet: aioredis.Redis) -> None:
    for worker_id in WORKER_IDS:
        await FleetStore(fleet, KEYS.prefix).set_state(worker_id, WorkerState.DRAINING)
    await asyncio.sleep(0.5)  # a few snapshot refreshes
    async with aiohttp.ClientSession() as session:
        status, worker, body = await _complete(session, gateway.url)
    assert status == 503 and worker is None, body
    assert json.loads(body)["error"]["code"] == "no_ready_worker"
