"""Redis with a password and over TLS (``rediss://``), and no secret in any log, page or printed line.

The stack case runs ``poolgate up`` against a TLS, password-protected redis-server with a controller token,
sends traffic, and then searches every log file, ``up``'s own output and the metrics pages for the password
and the token. TLS needs a redis-server built with TLS and the ``openssl`` command (both skip otherwise).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import yaml

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port, port_open

PASSWORD = "redis-pw-Zq81xk"
TOKEN = "ctl-token-Hr55vd"


def _wait_port(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_open("127.0.0.1", port):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port}")
        time.sleep(0.05)


@dataclass
class SecureRedis:
    plain_url: str
    tls_url: str | None
    """None when this redis-server or machine cannot do TLS."""
    process: subprocess.Popen[bytes]


def _self_signed(directory: Path) -> tuple[Path, Path] | None:
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.fixture(scope="module")
def secure_redis() -> Iterator[SecureRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    directory = Path(tempfile.mkdtemp(prefix="poolgate-redis-tls-"))
    port, tls_port = free_port(), free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(directory), "--requirepass", PASSWORD]
    pair = _self_signed(directory)
    tls_url = None
    if pair is not None:
        cert, key = pair
        cmd += ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
        tls_url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    log_path = directory / "redis.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(port)
    except AssertionError:
        process.kill()
        process.wait(5)
        output = log_path.read_text(errors="replace")
        if tls_url is not None and "TLS" in output:  # a build without TLS refuses the tls-* options
            pytest.skip(f"this redis-server has no TLS support: {output[-200:]}")
        raise
    yield SecureRedis(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", tls_url, process)
    process.terminate()
    process.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


async def _round_trip(url: str) -> list[WorkerRecord]:
    client = aioredis.from_url(url)
    store = FleetStore(client, "sec-redis")
    try:
        await store.register(WorkerRecord(id="w1", pool="chat", model="m", host="127.0.0.1", port=9000), 5.0)
        return await store.read_fleet()
    finally:
        await client.aclose()


def test_password_url_works_and_a_wrong_password_is_refused(secure_redis: SecureRedis) -> None:
    assert [w.id for w in asyncio.run(_round_trip(secure_redis.plain_url))] == ["w1"]
    with pytest.raises(redis.AuthenticationError):
        asyncio.run(_round_trip(secure_redis.plain_url.replace(PASSWORD, "wrong")))


def test_tls_url_with_password_works(secure_redis: SecureRedis) -> None:
    if secure_redis.tls_url is None:
        pytest.skip("no openssl to make a certificate")
    assert [w.id for w in asyncio.run(_round_trip(secure_redis.tls_url))] == ["w1"]
    # Verification is on: a client that does not trust the certificate is refused.
    untrusted = secure_redis.tls_url.split("?")[0]
    with pytest.raises(redis.ConnectionError):
        asyncio.run(_round_trip(untrusted))


CONFIG = {
    "key_prefix": "sec-stack",
    "controller": {"token": TOKEN, "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 1048576},
    "pools": [{"name": "chat", "model": "chat-model"}],
    "workers": [{"id": "chat-a", "pool": "chat"}],
}


@dataclass
class StackRun:
    redis_url: str
    run_dir: Path
    output: list[str]
    served: int
    pages: dict[str, str]
    """Metrics and admin pages read while the stack ran: name → text."""


@pytest.fixture(scope="module")
def secure_stack(secure_redis: SecureRedis) -> Iterator[StackRun]:
    redis_url = secure_redis.tls_url or secure_redis.plain_url
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-sec-"))
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    port, admin = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "up", "--config", str(config_path), "--port", str(port),
         "--admin-port", str(admin), "--redis-url", redis_url, "--log-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert process.stdout is not None
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout or []), daemon=True)
    reader.start()
    served = 0
    pages: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 90
        while not any(line.startswith("READY ") for line in output):
            assert process.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(0.1)
        body = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(10):
            served += httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                 timeout=10).status_code == 200
        controller_api = next(line.split("controller ready: api ")[1].split()[0]
                              for line in (run_dir / "controller.log").read_text().splitlines()
                              if "controller ready: api " in line)
        pages["controller /metrics"] = httpx.get(f"{controller_api}/metrics", timeout=5).text
        pages["envoy /stats"] = httpx.get(f"http://127.0.0.1:{admin}/stats", timeout=5).text
        pages["envoy /config_dump"] = httpx.get(f"http://127.0.0.1:{admin}/config_dump", timeout=5).text
        # A worker refused for a wrong token is logged; the log must not echo what was tried.
        httpx.post(f"{controller_api}/v1/workers", headers={"Authorization": f"Bearer {TOKEN}-wrong"}, json={})
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)
        process.stdout.close()
    yield StackRun(redis_url, run_dir, output, served, pages)
    shutil.rmtree(run_dir, ignore_errors=True)


def _leaks(text: str) -> list[str]:
    return [name for name, secret in (("redis password", PASSWORD), ("controller token", TOKEN)) if secret in text]


def test_stack_serves_over_the_secured_redis(secure_stack: StackRun) -> None:
    assert secure_stack.served == 10
    assert redact_url(secure_stack.redis_url) in "".join(secure_stack.output), "up did not print the redacted URL"


def test_no_secret_in_logs_output_or_metrics(secure_stack: StackRun) -> None:
    leaks = {"up output": _leaks("".join(secure_stack.output))}
    for path in sorted(secure_stack.run_dir.rglob("*")):
        if path.is_file() and path.name != "config.yaml" and path.name != "extproc.log":
            leaks[str(path.relative_to(secure_stack.run_dir))] = _leaks(path.read_text(errors="replace"))
    leaks |= {name: _leaks(text) for name, text in secure_stack.pages.items()}
    found = {name: what for name, what in leaks.items() if what}
    assert not found, f"secrets found: {found}"
    assert len(leaks) >= 8, f"too few places searched: {sorted(leaks)}"


def test_no_secret_in_extproc_log(secure_stack: StackRun) -> None:
    text = (secure_stack.run_dir / "extproc.log").read_text(errors="replace")
    assert not _leaks(text), [line for line in text.splitlines() if _leaks(line)][:3]
