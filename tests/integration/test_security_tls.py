"""TLS from certificate files between poolgate's parts, with certificates the test makes: the registry API
(HTTPS), the xDS server and extproc's gRPC port work over mutual TLS, refuse a client without a valid
certificate, and serve a rotated certificate from the next connection on, without a restart."""

from __future__ import annotations

import argparse
import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.main import _serve_api
from controller.probe import HttpProber
from controller.registry_api import RegistryApi
from controller.xds import XdsServer
from controller.xds.build import CLUSTER_TYPE_URL
from extproc.server import _grpc_server
from extproc.service import ExtProcService
from poolgate.controller_client import CommandError, call
from poolgate.kernel.config import ConfigError, TlsClientFiles, TlsServerFiles, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from poolgate.kernel.tls import ClientTls, ServerTls, worker_scheme
from poolgate.kernel.tls import client_context as files_context
from tests.tls_certs import Authority, TlsFiles, issue, make_ca, make_tls_files, write_atomically

CONFIG = parse_config({"pools": [{"name": "chat", "model": "m1"}]})
ROTATION_S = 5.0


def server_files(files: TlsFiles, mutual: bool = True) -> TlsServerFiles:
    return TlsServerFiles(cert_file=str(files.server_cert), key_file=str(files.server_key),
                          client_ca_file=str(files.ca) if mutual else None)


def stranger(tmp_path: Path) -> tuple[Path, Path]:
    """A client certificate signed by a CA the servers do not trust."""
    cert, key = issue(make_ca("stranger-ca"), "stranger", server=False)
    (tmp_path / "stranger.pem").write_bytes(cert)
    (tmp_path / "stranger-key.pem").write_bytes(key)
    return tmp_path / "stranger.pem", tmp_path / "stranger-key.pem"


def trust(tmp_path: Path, ca: Authority) -> Path:
    path = tmp_path / f"trust-{ca.name}.pem"
    path.write_bytes(ca.pem())
    return path


async def eventually(check: Callable[[], Awaitable[bool]], limit_s: float, what: str) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await check():
        if loop.time() - started > limit_s:
            raise AssertionError(f"{what}: not within {limit_s} s")
        await asyncio.sleep(0.05)
    return loop.time() - started


# ---------------------------------------------------------------- registry API (HTTPS)


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


async def healthz(url: str, context: ssl.SSLContext | bool) -> int | str:
    """The status of GET /healthz, or the error's class name when the connection was refused."""
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"{url}/healthz", ssl=context, timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status
    except (aiohttp.ClientError, ssl.SSLError, ConnectionError) as exc:
        return type(exc).__name__


async def operator_status(tmp_path: Path, url: str, files: TlsFiles, *, with_certificate: bool) -> int:
    """What ``poolgate`` operator commands get from the API: GET-free, so a POST to a path it answers."""
    operator: dict[str, str] = {"ca_file": str(files.ca)}
    if with_certificate:
        operator |= {"cert_file": str(files.client_cert), "key_file": str(files.client_key)}
    config = tmp_path / "operator.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "chat", "model": "m1"}], "controller": {"token": "tok"},
                                      "tls": {"operator": operator}}))
    args = argparse.Namespace(config=str(config), controller=url, redis_url=None, token=None)
    status, _ = await call(args, "/v1/heartbeats", {"workers": []})
    return status


async def test_registry_api_over_mutual_tls(tmp_path: Path, redis_client: aioredis.Redis) -> None:
    files, _ = make_tls_files(tmp_path)
    tls = ServerTls(server_files(files), "tls.registry_api")
    registry = RegistryApi(FleetStore(redis_client, "tls"), "tok", CONFIG.pools, CONFIG.controller)
    api = await _serve_api(registry, "127.0.0.1", 0, tls)
    url = api.url
    watch = asyncio.create_task(tls.watch(0.05))
    try:
        assert url.startswith("https://")
        assert await healthz(url, client_context(files.ca, files.client_cert, files.client_key)) == 200
        assert await healthz(url, client_context(files.ca)) != 200, "a client without a certificate got in"
        assert await healthz(url, client_context(files.ca, *stranger(tmp_path))) != 200
        assert await healthz(url.replace("https://", "http://"), False) != 200
        assert await operator_status(tmp_path, url, files, with_certificate=True) == 200
        with pytest.raises(CommandError, match="did not answer"):
            await operator_status(tmp_path, url, files, with_certificate=False)

        rotated = make_ca("rotated-ca")
        files.write_server(rotated)  # the client CA stays: clients keep their certificates
        new_trust = client_context(trust(tmp_path, rotated), files.client_cert, files.client_key)

        async def new_certificate_served() -> bool:
            return await healthz(url, new_trust) == 200

        took = await eventually(new_certificate_served, ROTATION_S, "the rotated certificate served")
        print(f"\nregistry API: rotated certificate served after {took:.2f} s, {tls.loads} loads")
        assert await healthz(url, client_context(files.ca, files.client_cert, files.client_key)) != 200
    finally:
        watch.cancel()
        await api.close()


def test_unreadable_certificate_files_stop_start_up_naming_the_field(tmp_path: Path) -> None:
    files = TlsServerFiles(cert_file=str(tmp_path / "missing.pem"), key_file=str(tmp_path / "missing-key.pem"))
    with pytest.raises(ConfigError, match=r"tls\.registry_api\.cert_file: cannot read"):
        ServerTls(files, "tls.registry_api")
    made, _ = make_tls_files(tmp_path)
    (tmp_path / "garbage.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"tls\.registry_api: cannot load"):
        ServerTls(TlsServerFiles(cert_file=str(tmp_path / "garbage.pem"), key_file=str(made.server_key)),
                  "tls.registry_api")


# ---------------------------------------------------------------- gRPC: xDS and extproc


def channel_credentials(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes() if key else None,
                                        cert.read_bytes() if cert else None)


async def first_clusters(port: int, credentials: grpc.ChannelCredentials) -> int | str:
    """How many clusters the first CDS answer holds, or the gRPC status when the call failed."""
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        try:
            request = discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE_URL)
            request.node.id = "tls-test"
            await call.write(request)
            response = await asyncio.wait_for(call.read(), 5)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        finally:
            call.cancel()
        assert isinstance(response, discovery_pb2.DiscoveryResponse)
        return len(response.resources)


async def test_xds_over_mutual_tls_and_rotation(tmp_path: Path) -> None:
    files, _ = make_tls_files(tmp_path)
    server = XdsServer(CONFIG.pools)
    server.update([])
    port = await server.start("127.0.0.1", 0, server_files(files))
    try:
        valid = channel_credentials(files.ca, files.client_cert, files.client_key)
        assert await first_clusters(port, valid) == 2  # pool-chat and the fallback
        assert await first_clusters(port, channel_credentials(files.ca)) == "UNAVAILABLE"
        assert await first_clusters(port, channel_credentials(files.ca, *stranger(tmp_path))) == "UNAVAILABLE"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(plain).StreamAggregatedResources()
            with pytest.raises(grpc.aio.AioRpcError):
                await call.write(discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE_URL))
                await asyncio.wait_for(call.read(), 5)

        rotated = make_ca("rotated-ca")
        files.write_server(rotated)
        new_trust = channel_credentials(trust(tmp_path, rotated), files.client_cert, files.client_key)

        async def new_certificate_served() -> bool:
            return await first_clusters(port, new_trust) == 2

        took = await eventually(new_certificate_served, ROTATION_S, "the rotated certificate served")
        print(f"\nxDS: rotated certificate served after {took:.2f} s")
        assert await first_clusters(port, valid) == "UNAVAILABLE"  # trusts only the old CA
    finally:
        await server.stop(0)


async def health_status(port: int, credentials: grpc.ChannelCredentials) -> str:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


async def test_extproc_port_over_mutual_tls(tmp_path: Path) -> None:
    files, _ = make_tls_files(tmp_path)
    service = cast(ExtProcService, ext_proc_grpc.ExternalProcessorServicer())  # only the port is under test
    server, _, port = await _grpc_server(service, "127.0.0.1", 0, 1 << 20, server_files(files))
    await server.start()
    try:
        # NOT_SERVING: reachable (no fleet snapshot yet, as at a real start)
        assert await health_status(port, channel_credentials(files.ca, files.client_cert,
                                                             files.client_key)) == "NOT_SERVING"
        assert await health_status(port, channel_credentials(files.ca)) == "UNAVAILABLE"
    finally:
        await server.stop(0)


async def https_worker(files: TlsServerFiles) -> tuple[web.AppRunner, WorkerRecord]:
    """A worker stand-in that answers /health over HTTPS from ``files``, and its record."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ServerTls(files, "worker").context).start()
    return runner, WorkerRecord(id="w1", pool="chat", model="m1", host="127.0.0.1", port=runner.addresses[0][1])


async def test_health_probes_reach_https_workers_with_the_client_certificate(tmp_path: Path) -> None:
    """With ``tls.workers`` the controller's probes speak HTTPS and present its certificate."""
    files, _ = make_tls_files(tmp_path)
    runner, record = await https_worker(server_files(files))
    client = TlsClientFiles(ca_file=str(files.ca), cert_file=str(files.client_cert), key_file=str(files.client_key))
    try:
        context = files_context(client)
        prober = HttpProber(5, False, scheme=worker_scheme(client), tls=context)
        assert (await prober.probe(record)).ok
        prober.close()
        assert not (await HttpProber(5, False).probe(record)).ok  # plain HTTP to a TLS worker
        anonymous = files_context(TlsClientFiles(ca_file=str(files.ca)))
        assert not (await HttpProber(5, False, scheme="https", tls=anonymous).probe(record)).ok
    finally:
        await runner.cleanup()


async def test_probes_present_a_rotated_client_certificate_without_a_restart(tmp_path: Path) -> None:
    """A worker that accepts only client certificates of a new CA: the probe's old certificate is refused;
    once its files are renamed into place, the same client context presents the new one."""
    files, _ = make_tls_files(tmp_path / "tls")
    new_ca = make_ca("new-client-ca")
    runner, record = await https_worker(TlsServerFiles(cert_file=str(files.server_cert), key_file=str(files.server_key),
                                                       client_ca_file=str(trust(tmp_path, new_ca))))
    client = ClientTls(TlsClientFiles(ca_file=str(files.ca), cert_file=str(files.client_cert),
                                      key_file=str(files.client_key)), "tls.workers")
    watch = asyncio.create_task(client.watch(0.05))

    async def probe_ok() -> bool:
        # a session per probe: a new connection each time, as after a pooled connection closes
        prober = HttpProber(5, False, scheme="https", tls=client.context)
        ok = (await prober.probe(record)).ok
        prober.close()
        return ok

    try:
        assert not await probe_ok()  # its certificate is from the old CA
        cert, key = issue(new_ca, "poolgate-client", server=False)
        write_atomically(files.client_key, key)
        write_atomically(files.client_cert, cert)
        took = await eventually(probe_ok, ROTATION_S, "the rotated client certificate presented")
        print(f"\nprobe client: rotated certificate presented after {took:.2f} s, {client.loads} loads")
    finally:
        watch.cancel()
        await runner.cleanup()
