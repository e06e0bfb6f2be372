"""``poolgate up`` with TLS on every hop, its locally launched workers serving HTTPS only (``tls.local_workers``,
client certificates required): the controller registers them after a health check over TLS, the agent
scrapes their metrics over TLS, Envoy reaches extproc, the xDS server and the workers over mutual TLS with
its certificates read through SDS, and an OpenAI SDK client gets answers, streamed and not."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import poolgate_up
from tests.tls_certs import TlsFiles, make_tls_files

pytestmark = pytest.mark.e2e

MODEL = "tls-chat"


def tls_up_config(files: TlsFiles, sds_dir: Path) -> dict[str, Any]:
    server = {"cert_file": str(files.server_cert), "key_file": str(files.server_key), "client_ca_file": str(files.ca)}
    client = {"ca_file": str(files.ca), "cert_file": str(files.client_cert), "key_file": str(files.client_key)}
    return {
        "key_prefix": "tlsup",
        "controller": {"token": "tls-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
        "pools": [{"name": "chat", "model": MODEL}],
        "workers": [{"id": "tls-a", "pool": "chat"}, {"id": "tls-b", "pool": "chat"}],
        "tls": {"xds": server, "extproc": server, "envoy": client, "workers": client, "local_workers": server,
                "envoy_sds_dir": str(sds_dir)},
    }


def worker_status(url: str, files: TlsFiles, *, certificate: bool) -> int | str:
    """The worker's answer to GET ``url``, or the error's class name when it turned the client away."""
    context = ssl.create_default_context(cafile=str(files.ca))
    if certificate:
        context.load_cert_chain(str(files.client_cert), str(files.client_key))
    try:
        return httpx.get(url, verify=context, timeout=5).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_locally_launched_workers_serve_only_https_and_answer_through_envoy(tmp_path: Path,
                                                                            redis_server: Any) -> None:
    files, _ = make_tls_files(tmp_path / "tls")
    with poolgate_up(tls_up_config(files, tmp_path / "envoy-sds"), redis_server.url) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
        try:
            for _ in range(4):
                reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4)
                assert reply.choices and reply.choices[0].message.content
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                    max_tokens=8, stream=True)
            finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
            assert finishes[-1] == "length", finishes
        finally:
            client.close()

        for worker in ("tls-a", "tls-b"):
            address = stack.address(worker)
            assert stack.state(worker) == "Ready"
            assert worker_status(f"https://{address}/health", files, certificate=True) == 200
            assert worker_status(f"https://{address}/health", files, certificate=False) != 200
            assert worker_status(f"http://{address}/health", files, certificate=True) != 200  # HTTPS only
        assert (stack.run_dir / "envoy.yaml").read_text().count("path_config_source") >= 2  # xDS, extproc: SDS

        deadline = time.monotonic() + 30  # the agent's scrapes (over TLS) stamp each record
        while not all(float(stack.record(w).get("metrics_at") or 0) > 0 for w in ("tls-a", "tls-b")):
            assert time.monotonic() < deadline, {w: stack.record(w) for w in ("tls-a", "tls-b")}
            time.sleep(0.2)
