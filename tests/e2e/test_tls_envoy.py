"""TLS end to end through real Envoy, with certificates the test makes: Envoy takes its xDS over mutual TLS
from the controller's xDS server and reaches a simulated worker that serves HTTPS and requires client
certificates; an OpenAI SDK client gets its answer; a client without a valid certificate is refused by the
worker; the worker's rotated certificate is served (and Envoy keeps reaching it) without a restart; and
Envoy's own client certificate and CA, rotated on disk, are used from the next connection on, without a
restart of Envoy (file-based SDS)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509

from controller.xds import XdsServer
from controller.xds.bootstrap import render_bootstrap
from controller.xds.envoy_tls import write_sds_files
from poolgate.kernel.config import Config, TlsServerFiles, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.procs import envoy_binary, free_port, port_open, stop_process
from simworker.worker import TLS_RELOAD_S
from tests.faults.harness import envoy_stat
from tests.run_dirs import run_directory
from tests.tls_certs import TlsFiles, make_ca, make_tls_files

pytestmark = pytest.mark.e2e

MODEL = "tls-model"


def tls_config(files: TlsFiles, sds_dir: Path) -> Config:
    client = {"ca_file": str(files.ca), "cert_file": str(files.client_cert), "key_file": str(files.client_key)}
    return parse_config({
        "pools": [{"name": "chat", "model": MODEL}],
        "tls": {
            "xds": {"cert_file": str(files.server_cert), "key_file": str(files.server_key),
                    "client_ca_file": str(files.ca)},
            "envoy": client,
            "workers": {**client, "server_name": "localhost"},
            "envoy_sds_dir": str(sds_dir),
        },
    })


def refused_with_certificate(port: int, files: TlsFiles, trust: Path | None = None) -> bool:
    """Whether the worker turns away ``files``' client certificate (its chain checked against ``trust``, by
    default ``files``' CA)."""
    context = ssl.create_default_context(cafile=str(trust or files.ca))
    context.load_cert_chain(str(files.client_cert), str(files.client_key))
    try:
        httpx.get(f"https://localhost:{port}/health", verify=context, timeout=5).raise_for_status()
    except httpx.HTTPError:
        return True
    return False


def served_serial(port: int, files: TlsFiles) -> int:
    """The serial number of the certificate the worker presents now (a new connection)."""
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.client_cert), str(files.client_key))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as wrapped:
        der = wrapped.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def launch(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def refused(url: str, files: TlsFiles) -> bool:
    """True when the worker turns this client away: no client certificate, or no TLS at all."""
    try:
        httpx.get(url, verify=ssl.create_default_context(cafile=str(files.ca)), timeout=5).raise_for_status()
    except httpx.HTTPError:
        return True
    return False


async def start_worker(port: int, files: TlsFiles, log_path: Path) -> subprocess.Popen[bytes]:
    """A simulated worker serving HTTPS from ``files`` and requiring client certificates from their CA."""
    worker = launch(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--model", MODEL,
         "--worker-id", "tls-w1", "--time-scale", "4", "--ssl-certfile", str(files.server_cert),
         "--ssl-keyfile", str(files.server_key), "--ssl-ca-certs", str(files.ca)], log_path)
    for _ in range(1200):  # a loaded machine starts Python slowly
        if port_open("127.0.0.1", port):
            return worker
        await asyncio.sleep(0.05)
    stop_process(worker)
    raise AssertionError(f"the simulated worker did not open port {port} within 60 s")


def start_envoy(config: Config, *, listen_port: int, admin_port: int, xds_port: int,
                log_path: Path) -> subprocess.Popen[bytes]:
    """Envoy from the wheel with poolgate's bootstrap (no extproc: requests fail open to the fallback
    cluster), after writing the SDS files its TLS contexts read."""
    write_sds_files(config.tls)
    bootstrap = render_bootstrap(config, node_id="tls-envoy", listen_port=listen_port, admin_port=admin_port,
                                 extproc_port=free_port(), xds_port=xds_port)
    return launch([str(envoy_binary()), "--config-yaml", json.dumps(bootstrap), "--use-dynamic-base-id",
                   "--disable-hot-restart", "-l", "warning", "--concurrency", "1"], log_path)


def worker_record(port: int) -> WorkerRecord:
    return WorkerRecord(id="tls-w1", pool="chat", model=MODEL, host="127.0.0.1", port=port)


def xds_files(files: TlsFiles) -> TlsServerFiles:
    return TlsServerFiles(cert_file=str(files.server_cert), key_file=str(files.server_key),
                          client_ca_file=str(files.ca))


async def answered(client: openai.AsyncOpenAI) -> bool:
    try:
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3)
    except openai.OpenAIError:
        return False
    return bool(reply.choices)


async def poll(check: Callable[[], Awaitable[bool]], limit_s: float, what: str, log_path: Path) -> float:
    """Seconds until ``check`` holds (AssertionError with Envoy's log tail past ``limit_s``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await check():
        if loop.time() - started > limit_s:
            log = await asyncio.to_thread(log_path.read_text, errors="replace")
            raise AssertionError(f"{what}: not within {limit_s} s\n{log[-2000:]}")
        await asyncio.sleep(0.1)
    return loop.time() - started


@pytest.fixture()
async def tls_stack() -> AsyncIterator[dict[str, Any]]:
    run_dir = run_directory("poolgate-tls-")
    files, ca = make_tls_files(run_dir)
    config = tls_config(files, run_dir / "envoy-sds")
    assert config.tls.xds is not None
    xds = XdsServer(config.pools, config.tls)
    xds_port = await xds.start("127.0.0.1", 0, config.tls.xds)
    worker_port, envoy_port, admin_port = free_port(), free_port(), free_port()
    worker = await start_worker(worker_port, files, run_dir / "worker.log")
    envoy = start_envoy(config, listen_port=envoy_port, admin_port=admin_port, xds_port=xds_port,
                        log_path=run_dir / "envoy.log")
    try:
        xds.update([worker_record(worker_port)])
        yield {"files": files, "ca": ca, "xds": xds, "envoy_port": envoy_port, "admin_port": admin_port,
               "worker_port": worker_port, "run_dir": run_dir}
    finally:
        stop_process(envoy)
        stop_process(worker)
        await xds.stop(0)


async def test_requests_cross_every_tls_hop_and_a_rotated_certificate_is_served(tls_stack: dict[str, Any]) -> None:
    files: TlsFiles = tls_stack["files"]
    worker_port = tls_stack["worker_port"]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tls_stack['envoy_port']}/v1", api_key="unused",
                                max_retries=0, timeout=10)
    try:
        # Envoy gets its endpoints over mutual TLS, then reaches the worker over TLS
        await poll(lambda: answered(client), 60, "an answer through Envoy over TLS", tls_stack["run_dir"] / "envoy.log")
        streams = tls_stack["xds"].streams()
        assert [s.node_id for s in streams] == ["tls-envoy"] and not streams[0].errors

        assert await asyncio.to_thread(refused, f"https://127.0.0.1:{worker_port}/health", files)
        assert await asyncio.to_thread(refused, f"http://127.0.0.1:{worker_port}/health", files)
        assert not await asyncio.to_thread(  # the check itself: with the certificate, the worker answers
            lambda: refused_with_certificate(worker_port, files))

        before = served_serial(worker_port, files)
        files.write_server(tls_stack["ca"])  # a new leaf from the same CA: Envoy trusts it as it is
        loop = asyncio.get_running_loop()
        started = loop.time()
        while served_serial(worker_port, files) == before:
            assert loop.time() - started < 4 * TLS_RELOAD_S, "the rotated certificate was not picked up"
            await asyncio.sleep(0.2)
        print(f"\nworker TLS: rotated certificate served after {loop.time() - started:.1f} s "
              f"(looked at every {TLS_RELOAD_S:g} s)")
        results = [await answered(client) for _ in range(5)]
        assert all(results), results
    finally:
        await client.close()


async def test_envoy_uses_its_rotated_client_certificate_and_ca_without_a_restart(tmp_path: Path) -> None:
    """Every server moves to a new CA and accepts only client certificates from it: Envoy, holding the old
    ones, is refused; once its files on disk are replaced (renamed into place) it reaches the new worker and
    the new xDS server with them, and it is the same Envoy process throughout."""
    old_ca, new_ca = make_ca("old-ca"), make_ca("new-ca")
    old_servers, _ = make_tls_files(tmp_path / "old", old_ca)
    new_servers, _ = make_tls_files(tmp_path / "new", new_ca)
    envoy_files, _ = make_tls_files(tmp_path / "envoy", old_ca)  # Envoy's CA bundle and client certificate
    config = tls_config(envoy_files, tmp_path / "envoy-sds")
    xds = XdsServer(config.pools, config.tls)
    xds_port = await xds.start("127.0.0.1", 0, xds_files(old_servers))
    worker_port, envoy_port, admin_port = free_port(), free_port(), free_port()
    worker = await start_worker(worker_port, old_servers, tmp_path / "worker-old.log")
    envoy_log = tmp_path / "envoy.log"
    envoy = start_envoy(config, listen_port=envoy_port, admin_port=admin_port, xds_port=xds_port, log_path=envoy_log)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{envoy_port}/v1", api_key="unused", max_retries=0,
                                timeout=10)

    async def reconnected() -> bool:
        return [s.node_id for s in xds.streams()] == ["tls-envoy"]

    def sds_updates(cluster: str) -> int:
        return int(envoy_stat(admin_port, f"cluster.{cluster}.client_ssl_socket_factory.ssl_context_update_by_sds")
                   or 0)

    try:
        xds.update([worker_record(worker_port)])
        await poll(lambda: answered(client), 60, "an answer with the old certificates", envoy_log)
        before = {c: sds_updates(c) for c in ("poolgate-xds", "poolgate-fallback")}

        # The servers move to the new CA: a new worker on the same port, the xDS server restarted.
        stop_process(worker)
        worker = await start_worker(worker_port, new_servers, tmp_path / "worker-new.log")
        await xds.stop(0)
        xds = XdsServer(config.pools, config.tls)
        await xds.start("127.0.0.1", xds_port, xds_files(new_servers))
        xds.update([worker_record(worker_port)])
        assert not await asyncio.to_thread(refused_with_certificate, worker_port, new_servers)  # it serves
        assert await asyncio.to_thread(refused_with_certificate, worker_port, envoy_files,  # not the old one
                                       new_servers.ca)
        assert not await answered(client), "Envoy got through with its old certificate and CA"

        envoy_files.write_ca(new_ca)
        envoy_files.write_client(new_ca)
        routed = await poll(lambda: answered(client), 60, "an answer with the rotated certificates", envoy_log)
        resumed = await poll(reconnected, 60, "Envoy's xDS stream with the rotated certificates", envoy_log)
        print(f"\nEnvoy TLS (file-based SDS): rotated client certificate and CA used after {routed:.2f} s "
              f"(worker) and {routed + resumed:.2f} s (xDS stream back, after Envoy's reconnect backoff)")
        assert envoy.poll() is None, "Envoy restarted"
        after = {c: sds_updates(c) for c in before}
        assert all(after[c] > before[c] for c in before), (before, after)
        assert all(await asyncio.gather(*(answered(client) for _ in range(5))))
    finally:
        await client.close()
        stop_process(envoy)
        stop_process(worker)
        await xds.stop(0)
