"""Fleet changes reach Envoy quickly, and extproc's absence does not stop traffic (fail-open)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from poolgate.procs import free_port, stop_process
from tests.e2e.conftest import E2E_CONFIG, RunningStack, poolgate_up

pytestmark = pytest.mark.e2e


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> float:
    """Poll with a generous bound; return the time it actually took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


class ExternalWorker:
    """A simulated worker this test starts itself and registers through the controller's API."""

    def __init__(self, stack: RunningStack, worker_id: str) -> None:
        self.stack = stack
        self.worker_id = worker_id
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(self.port), "--model", "chat-model",
             "--worker-id", worker_id], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.api = httpx.Client(base_url=stack.controller_url(), timeout=5,
                                headers={"Authorization": "Bearer e2e-token"})
        self.beating = threading.Event()
        self.thread: threading.Thread | None = None

    def wait_ready(self) -> None:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://{self.address}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(healthy, 30)

    def register(self) -> None:
        response = self.api.post("/v1/workers", json={"id": self.worker_id, "pool": "chat", "host": "127.0.0.1",
                                                      "port": self.port})
        assert response.status_code == 201, response.text
        self.beating.set()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while self.beating.is_set():
            self.api.post(f"/v1/workers/{self.worker_id}/heartbeat", json={})
            time.sleep(0.25)

    def stop_heartbeats(self) -> None:
        self.beating.clear()
        if self.thread:
            self.thread.join(2)

    def close(self) -> None:
        self.stop_heartbeats()
        self.api.close()
        stop_process(self.process, grace_s=30)  # killed if a loaded machine stops it too slowly: never left behind


@pytest.fixture()
def external_worker(stack: RunningStack) -> Iterator[ExternalWorker]:
    worker = ExternalWorker(stack, "ext-1")
    yield worker
    worker.close()


def test_worker_joins_and_leaves_envoy_within_two_seconds(stack: RunningStack,
                                                          external_worker: ExternalWorker) -> None:
    external_worker.wait_ready()
    external_worker.register()
    joined = wait_for(lambda: stack.envoy_hosts("pool-chat").get(external_worker.address) == ["healthy"])
    external_worker.stop_heartbeats()
    left = wait_for(lambda: external_worker.address not in stack.envoy_hosts("pool-chat"))
    external_worker.register()
    wait_for(lambda: external_worker.address in stack.envoy_hosts("pool-chat"))
    external_worker.stop_heartbeats()
    assert external_worker.api.delete(f"/v1/workers/{external_worker.worker_id}").status_code == 204
    deregistered = wait_for(lambda: external_worker.address not in stack.envoy_hosts("pool-chat"))
    print(f"\nmeasured: joined Envoy {joined:.2f} s after registering; left {left:.2f} s after the last "
          f"heartbeat (TTL {stack.config['controller']['heartbeat_ttl_s']} s); left {deregistered:.2f} s "  # type: ignore[index]
          "after deregistering")


def chat_ok(stack: RunningStack) -> bool:
    """A chat request carrying the client's own key, which no worker accepts."""
    response = httpx.post(f"{stack.base_url}/chat/completions", timeout=30,
                          headers={"Authorization": "Bearer a-client-key"},
                          json={"model": "chat-model", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2})
    return response.status_code == 200


def listed_models(stack: RunningStack) -> set[str]:
    try:
        return {m["id"] for m in httpx.get(f"{stack.base_url}/models", timeout=5).json()["data"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return set()


WORKER_KEY = "e2e-worker-key"


@pytest.fixture()
def own_stack(redis_server: object) -> Iterator[RunningStack]:
    """A stack of its own: this test stops and kills extproc, which must not disturb the shared stack. Its
    workers require an API key (vLLM's ``--api-key``), which only poolgate holds."""
    config = {**E2E_CONFIG, "key_prefix": "e2e-fail-open", "worker_api_key_env": "E2E_WORKER_KEY",
              "workers": [w for w in E2E_CONFIG["workers"] if w["id"] in ("chat-a", "code-a")]}
    with poolgate_up(config, redis_server.url, env={"E2E_WORKER_KEY": WORKER_KEY}) as running:  # type: ignore[attr-defined]
        yield running


def test_keyed_workers_served_through_extproc_and_fail_open_when_it_hangs_or_dies(own_stack: RunningStack) -> None:
    stack = own_stack
    worker = f"http://{stack.address('chat-a')}/v1/models"
    assert httpx.get(worker, headers={"Authorization": "Bearer a-client-key"}, timeout=5).status_code == 401
    assert httpx.get(worker, headers={"Authorization": f"Bearer {WORKER_KEY}"}, timeout=5).status_code == 200
    # The health monitor checks /v1/models every 0.5 s and fails a worker after 3 misses: with the key sent
    # the workers stay Ready, and requests with the client's key reach them through extproc.
    time.sleep(2.0)
    assert stack.state("chat-a") == "Ready", stack.record("chat-a")
    assert chat_ok(stack)
    extproc_pid = stack.children()["extproc"]
    os.kill(extproc_pid, signal.SIGSTOP)
    try:
        hung = [chat_ok(stack) for _ in range(5)]
    finally:
        os.kill(extproc_pid, signal.SIGCONT)
    assert all(hung), f"requests while extproc hung: {hung}"
    os.kill(extproc_pid, signal.SIGKILL)
    gone = [chat_ok(stack) for _ in range(5)]
    assert all(gone), f"requests while extproc was down: {gone}"
    # `poolgate up` restarts it, and routing through extproc resumes (a pinned pool again).
    wait_for(lambda: stack.children()["extproc"] != extproc_pid, 20)
    # Only extproc lists both pools' models; a worker reached by the fail-open route lists its own.
    wait_for(lambda: {"chat-model", "code-model"} <= listed_models(stack), 30)
    assert chat_ok(stack)
