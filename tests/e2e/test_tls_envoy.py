"""TLS end to end through real Envoy, with certificates the test makes: Envoy takes its xDS over mutual TLS
from the controller's xDS server and reaches a simulated worker that serves HTTPS and requires client
certificates; an OpenAI SDK client gets its answer; a client without a valid certificate is refused by the
worker; the worker's rotated certificate is served (and Envoy keeps reaching it) without a restart."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509

from controller.xds.server import XdsServer
from poolgate.envoy_bootstrap import render_bootstrap
from poolgate.kernel.config import Config, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.procs import envoy_binary, free_port, port_open, stop_process
from simworker.worker import TLS_RELOAD_S
from tests.tls_certs import TlsFiles, make_tls_files

pytestmark = pytest.mark.e2e

MODEL = "tls-model"


def tls_config(files: TlsFiles) -> Config:
    client = {"ca_file": str(files.ca), "cert_file": str(files.client_cert), "key_file": str(files.client_key)}
    return parse_config({
        "pools": [{"name": "chat", "model": MODEL}],
        "tls": {
            "xds": {"cert_file": str(files.server_cert), "key_file": str(files.server_key),
                    "client_ca_file": str(files.ca)},
            "envoy": client,
            "workers": {**client, "server_name": "localhost"},
        },
    })


def refused_with_certificate(port: int, files: TlsFiles) -> bool:
    context = ssl.create_default_context(cafile=str(files.ca))
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


@pytest.fixture()
async def tls_stack() -> AsyncIterator[dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-tls-"))
    files, ca = make_tls_files(run_dir)
    config = tls_config(files)
    assert config.tls.xds is not None
    xds = XdsServer(config.pools, config.tls.workers)
    xds_port = await xds.start("127.0.0.1", 0, config.tls.xds)
    worker_port, envoy_port, admin_port = free_port(), free_port(), free_port()
    worker = launch(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(worker_port), "--model", MODEL,
         "--worker-id", "tls-w1", "--time-scale", "4", "--ssl-certfile", str(files.server_cert),
         "--ssl-keyfile", str(files.server_key), "--ssl-ca-certs", str(files.ca)], run_dir / "worker.log")
    bootstrap = render_bootstrap(config, node_id="tls-envoy", listen_port=envoy_port, admin_port=admin_port,
                                 extproc_port=free_port(), xds_port=xds_port)  # no extproc: fail-open
    envoy = launch([str(envoy_binary()), "--config-yaml", json.dumps(bootstrap), "--use-dynamic-base-id",
                    "--disable-hot-restart", "-l", "warning", "--concurrency", "1"], run_dir / "envoy.log")
    try:
        for _ in range(300):
            if port_open("127.0.0.1", worker_port):
                break
            await asyncio.sleep(0.05)
        xds.update([WorkerRecord(id="tls-w1", pool="chat", model=MODEL, host="127.0.0.1", port=worker_port)])
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

    async def answered() -> bool:
        try:
            reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=3)
        except openai.OpenAIError:
            return False
        return bool(reply.choices)

    try:
        for _ in range(300):  # Envoy gets its endpoints over mutual TLS, then reaches the worker over TLS
            if await answered():
                break
            await asyncio.sleep(0.1)
        else:
            logs = (tls_stack["run_dir"] / "envoy.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"no answer through Envoy over TLS\n{logs}")
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
        results = [await answered() for _ in range(5)]
        assert all(results), results
    finally:
        await client.close()
