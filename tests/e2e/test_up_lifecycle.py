"""``poolgate up`` as a user runs it: ready line, demo, and a clean stop that leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from poolgate.procs import free_port
from tests.e2e.conftest import pid_alive, poolgate_up

pytestmark = pytest.mark.e2e

SMALL_CONFIG = {
    "key_prefix": "lifecycle",
    "pools": [{"name": "chat", "model": "chat-model"}],
    "workers": [{"id": "only-1", "pool": "chat"}],
}


def start_up(tmp_path: Path, redis_url: str, *extra: str) -> subprocess.Popen[str]:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(SMALL_CONFIG))
    return subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "up", "--config", str(config), "--port", str(free_port()),
         "--redis-url", redis_url, "--log-dir", str(tmp_path / "run"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def all_pids(run_dir: Path) -> list[int]:
    """Children of `up` and the workers the controller(s) started."""
    pids = list(json.loads((run_dir / "children.json").read_text()).values())
    controller_log = (run_dir / "controller.log").read_text()
    pids += [int(p) for p in re.findall(r"started worker \S+ \(pid (\d+)\)", controller_log)]
    return pids


def read_until_ready(process: subprocess.Popen[str], timeout_s: float = 120) -> list[str]:
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("READY "):
            return lines
    process.kill()
    raise AssertionError("no READY line:\n" + "".join(lines))


def wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def test_up_demo_then_exit(tmp_path: Path, redis_url: str) -> None:
    process = start_up(tmp_path, redis_url, "--demo", "--exit-after-demo")
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 0, out
    assert re.search(r"^READY http://127\.0\.0\.1:\d+/v1$", out, re.MULTILINE), out
    assert "only-1" in out and "Ready" in out  # the status table
    assert re.search(r"demo: 48 requests, concurrency 8, 0 failed", out), out
    assert not wait_gone(all_pids(tmp_path / "run"))


def test_sigterm_after_a_child_crashed_leaves_no_orphans(tmp_path: Path, redis_url: str) -> None:
    process = start_up(tmp_path, redis_url)
    read_until_ready(process)
    run_dir = tmp_path / "run"
    controller = json.loads((run_dir / "children.json").read_text())["controller"]
    os.kill(controller, signal.SIGKILL)  # its worker is orphaned; `up` must still clean it up
    deadline = time.monotonic() + 30
    while json.loads((run_dir / "children.json").read_text())["controller"] == controller:
        assert time.monotonic() < deadline, "up did not restart the controller"
        time.sleep(0.1)
    pids = all_pids(run_dir)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 0
    assert not wait_gone(pids), "processes left behind after SIGTERM"


def test_up_is_ready_with_pools_of_every_kind_and_no_keys(redis_server: object) -> None:
    """READY waits until each model answers through Envoy, each asked what its kind serves: without API keys
    (where a 401 would do) an embedding, cross-encoder or speech pool never answers a chat, and READY never
    came."""
    config = {"key_prefix": "lifecycle-kinds",
              "pools": [{"name": "chat", "model": "chat-model"},
                        {"name": "embed", "model": "embed-model", "task": "embed"},
                        {"name": "rerank", "model": "rerank-model", "task": "score"},
                        {"name": "speech", "model": "speech-model", "task": "transcription"}],
              "workers": [{"id": f"{pool}-a", "pool": pool} for pool in ("chat", "embed", "rerank", "speech")]}
    started = time.monotonic()
    with poolgate_up(config, redis_server.url, timeout_s=120) as stack:  # type: ignore[attr-defined]
        print(f"READY after {time.monotonic() - started:.1f} s with four kinds of pool")
        answer = httpx.post(f"{stack.base_url}/embeddings", json={"model": "embed-model", "input": "x"}, timeout=10)
        assert answer.status_code == 200, answer.text
