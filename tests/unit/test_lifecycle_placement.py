"""GPU-aware placement and the ``vllm serve`` command a placed worker gets."""

from __future__ import annotations

import pytest

from controller.local_backend import vllm_command, worker_command
from controller.placement import GpuFree, place
from poolgate.kernel.config import ConfigError, parse_config

GPUS = {0: GpuFree(0, 81920, 30000), 1: GpuFree(1, 81920, 70000), 2: GpuFree(2, 81920, 50000)}


def test_most_free_gpus_that_fit_are_chosen() -> None:
    assert place(40000, 1, GPUS).gpus == (1,)
    assert place(40000, 2, GPUS).gpus == (1, 2)


def test_pending_reservations_count_as_used() -> None:
    assert place(40000, 1, GPUS, {1: 40000}).gpus == (2,)


def test_refusal_says_what_was_needed_and_what_is_free() -> None:
    placement = place(60000, 2, GPUS)
    assert not placement.placed and placement.gpus == ()
    assert "needs 2 GPU(s) with 60000 MiB" in placement.reason and "GPU 1: 70000 MiB" in placement.reason


def test_no_gpu_facts_refuses_and_no_gpu_needed_places() -> None:
    assert not place(1000, 1, {}).placed
    assert place(1000, 0, {}).placed


def test_vllm_command_from_placement() -> None:
    cmd, env = vllm_command("meta-llama/Llama-3.1-8B-Instruct", host="0.0.0.0", port=8001,
                            served_names=("llama-3.1-8b",), max_model_len=16384, gpu_memory_utilization=0.45,
                            gpus=(2, 3), extra_args=("--enforce-eager", "--disable-log-stats"))
    assert cmd[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    text = " ".join(cmd)
    assert "--port 8001" in text and "--served-model-name llama-3.1-8b" in text
    assert "--max-model-len 16384" in text and "--gpu-memory-utilization 0.45" in text
    assert "--tensor-parallel-size 2" in text and "--enforce-eager" in text
    assert "--disable-log-stats" not in cmd  # the agent needs the engine's metrics
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_vllm_command_single_gpu_keeps_explicit_tp() -> None:
    cmd, env = vllm_command("m", host="127.0.0.1", port=1, served_names=("a", "b"), max_model_len=1,
                            gpu_memory_utilization=0.9, gpus=(0,))
    assert "--tensor-parallel-size" not in cmd and env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert cmd[cmd.index("--served-model-name") + 1: cmd.index("--served-model-name") + 3] == ["a", "b"]


def test_workers_get_their_api_key_in_the_environment_never_on_the_command_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m"}], "worker_api_key_env": "WORKER_KEY",
                           "workers": [{"id": "sim", "pool": "chat"},
                                       {"id": "gpu", "pool": "chat", "backend": "vllm", "model_path": "org/m",
                                        "gpus": [1]}]})
    with pytest.raises(ConfigError, match=r"worker_api_key_env: \$WORKER_KEY is not set"):
        worker_command(config, config.workers[0], 8001)
    monkeypatch.setenv("WORKER_KEY", "k-123")
    for spec, expected in zip(config.workers, ({"VLLM_API_KEY": "k-123"},
                                               {"VLLM_API_KEY": "k-123", "CUDA_VISIBLE_DEVICES": "1"}), strict=True):
        cmd, env = worker_command(config, spec, 8001)
        assert env == expected and "k-123" not in " ".join(cmd)
    without = parse_config({"pools": [{"name": "chat", "model": "m"}], "workers": [{"id": "sim", "pool": "chat"}]})
    assert worker_command(without, without.workers[0], 8001)[1] == {}


def test_workers_of_a_base_with_adapters_start_ready_to_load_them_at_run_time() -> None:
    config = parse_config({
        "pools": [{"name": "chat", "model": "m"}, {"name": "code", "model": "c"}],
        "catalogue": {"adapters": [{"name": "sql", "base": "m", "path": "/a/sql"},
                                   {"name": "legal", "base": "m", "path": "/a/legal"},
                                   {"name": "preloaded", "base": "m"},  # no path: never loaded at run time
                                   {"name": "py", "base": "c", "path": "/a/py"}]},
        "workers": [{"id": "sim", "pool": "chat"},
                    {"id": "gpu", "pool": "chat", "backend": "vllm", "model_path": "org/m",
                     "extra_args": ["--max-loras=4", "--max-lora-rank", "64"]},
                    {"id": "other", "pool": "code", "backend": "vllm", "model_path": "org/c"}]})
    sim, gpu, other = (worker_command(config, spec, 8001) for spec in config.workers)
    assert " --enable-lora --max-loras 2" in " ".join(sim[0]) and sim[1] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert gpu[0].count("--enable-lora") == 1 and "--max-loras=4" in gpu[0] and "--max-loras" not in gpu[0]
    assert gpu[1]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert " --enable-lora --max-loras 1" in " ".join(other[0])
    plain = parse_config({"pools": [{"name": "chat", "model": "m"}], "workers": [{"id": "sim", "pool": "chat"}]})
    assert "--enable-lora" not in worker_command(plain, plain.workers[0], 8001)[0]
