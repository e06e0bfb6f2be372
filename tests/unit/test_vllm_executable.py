"""A real vLLM in its own venv: the worker names the ``vllm`` to run, and ``poolgate up`` waits for engines that
take a minute or more to load."""

from __future__ import annotations

from pathlib import Path

from controller.local_backend import vllm_command
from poolgate.kernel.config import load_config
from poolgate.up import READY_TIMEOUT_S, READY_TIMEOUT_VLLM_S, ready_timeout

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_the_worker_names_its_vllm_executable() -> None:
    cmd, env = vllm_command(".vllm-models/tiny", host="127.0.0.1", port=8000, served_names=("tiny",),
                            max_model_len=2048, gpu_memory_utilization=0.9, gpus=(), kv_cache_gib=1,
                            executable=".venv-vllm/bin/vllm")
    assert cmd[:3] == [".venv-vllm/bin/vllm", "serve", ".vllm-models/tiny"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_command("m", host="h", port=1, served_names=("m",), max_model_len=8, gpu_memory_utilization=0.9,
                        gpus=(0,))[0][0] == "vllm"  # from PATH by default


def test_local_vllm_config_runs_the_venvs_vllm_on_the_tiny_model() -> None:
    config = load_config(DEPLOY / "local-vllm.yaml")
    engines = [w for w in config.workers if w.backend == "vllm"]
    assert len(engines) == 2
    assert {(w.vllm_executable, w.model_path, w.kv_cache_gib) for w in engines} == {
        (".venv-vllm/bin/vllm", ".vllm-models/tiny", 1)}
    assert config.pool("tiny").tokenizer is not None


def test_up_waits_longer_for_real_engines() -> None:
    assert ready_timeout(load_config(DEPLOY / "local-vllm.yaml")) == READY_TIMEOUT_VLLM_S
    assert ready_timeout(load_config(DEPLOY / "local.yaml")) == READY_TIMEOUT_S < READY_TIMEOUT_VLLM_S
