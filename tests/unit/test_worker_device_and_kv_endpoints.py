"""What a real vLLM (the CPU build, ``tests/fixtures/vllm-0.32-cpu``) showed the launch must get right.

- On CPU, ``--gpu-memory-utilization`` is a share of the machine's RAM (vLLM refuses to start when less is
  free) and the KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB): ``workers[].kv_cache_gib``.
- vLLM's KV-event publisher binds only for ``tcp://*:P``, ``ipc://`` and ``inproc://`` (and addresses with
  ``::``); for ``tcp://HOST:P`` it connects, so no event ever arrives: refused at load, naming the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from controller.kv_events_launch import kv_events_launch
from controller.local_backend import LocalProcessBackend, worker_command
from poolgate.kernel.config import ConfigError, ControllerSettings, PlacementSettings, parse_config

POOLS = [{"name": "chat", "model": "tiny", "max_model_len": 2048}]


def _kv_events(endpoint: str, replay: str | None = None) -> list[str]:
    config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    if replay is not None:
        config["replay_endpoint"] = replay
    return ["--kv-events-config", json.dumps(config)]


def test_a_cpu_worker_gets_a_kv_cache_size_and_no_gpu_share() -> None:
    config = parse_config({"pools": POOLS, "workers": [
        {"id": "cpu", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", "kv_cache_gib": 2},
        {"id": "gpu", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", "gpus": [0]}]})
    cmd, env = worker_command(config, config.workers[0], 8001)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert "--gpu-memory-utilization" not in cmd and "CUDA_VISIBLE_DEVICES" not in env
    assert cmd[:3] == ["vllm", "serve", "/models/tiny"] and "--max-model-len" in cmd
    gpu_cmd, gpu_env = worker_command(config, config.workers[1], 8002)  # GPU workers as before
    assert gpu_cmd[gpu_cmd.index("--gpu-memory-utilization") + 1] == "0.9"
    assert gpu_env == {"CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize(("worker", "expected"), [
    ({"kv_cache_gib": 0}, "workers.0.kv_cache_gib: Input should be greater than 0"),
    ({"kv_cache_gib": -4}, "workers.0.kv_cache_gib: Input should be greater than 0"),
    ({"kv_cache_gib": 1.5}, "workers.0.kv_cache_gib: Input should be a valid integer"),
    ({"kv_cache_gib": 2, "gpus": [0]}, "workers.0.kv_cache_gib: kv_cache_gib makes this a CPU worker"),
    ({"kv_cache_gib": 2, "backend": "sim"}, "workers.0.kv_cache_gib: kv_cache_gib sizes a real vLLM engine"),
])
def test_a_bad_cpu_worker_is_refused_at_load_naming_the_field(worker: dict[str, object], expected: str) -> None:
    spec = {"id": "cpu", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", **worker}
    with pytest.raises(ConfigError) as error:
        parse_config({"pools": POOLS, "workers": [spec]})
    assert expected in str(error.value)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://10.0.0.5:5557", "tcp://0.0.0.0:5557",
                                      "tcp://worker-1:5557"])
def test_a_kv_events_endpoint_vllm_would_connect_to_is_refused_with_the_fix(endpoint: str) -> None:
    spec = {"id": "w", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny",
            "extra_args": _kv_events(endpoint)}
    with pytest.raises(ConfigError) as error:
        parse_config({"pools": POOLS, "workers": [spec]})
    message = str(error.value)
    assert "workers.0.extra_args: --kv-events-config: endpoint" in message
    assert "connect instead of bind" in message and "use 'tcp://*:5557'" in message
    template = {"backend": "vllm", "model_path": "/models/tiny", "extra_args": _kv_events(endpoint)}
    with pytest.raises(ConfigError, match=r"autoscale.pools.chat.template.extra_args: --kv-events-config"):
        parse_config({"pools": POOLS, "autoscale": {"pools": {"chat": {"template": template}}}})


@pytest.mark.parametrize(("endpoint", "replay", "field"), [("tcp://*:0", "tcp://*:5558", "endpoint"),
                                                         ("tcp://*:5557", "tcp://*:0", "replay_endpoint")])
def test_a_port_vllm_would_choose_itself_is_refused(endpoint: str, replay: str, field: str) -> None:
    spec = {"id": "w", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny",
            "extra_args": _kv_events(endpoint, replay)}
    with pytest.raises(ConfigError, match=rf"workers.0.extra_args: --kv-events-config: {field} .* give a fixed port"):
        parse_config({"pools": POOLS, "workers": [spec]})


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "ipc:///tmp/kv.sock", "inproc://kv", "tcp://[::]:5557"])
def test_endpoints_vllm_binds_are_accepted_and_reach_the_record(endpoint: str) -> None:
    args = _kv_events(endpoint, replay="tcp://*:5558")
    spec = {"id": "w", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", "extra_args": args}
    config = parse_config({"pools": POOLS, "workers": [spec]})
    launch = kv_events_launch(config.workers[0].extra_args, "10.1.2.3", Path("/unused"), 0)
    assert launch.args == ()  # the user's own flag is passed through unchanged
    assert launch.endpoint == endpoint.replace("tcp://*:", "tcp://10.1.2.3:").replace("tcp://[::]:", "tcp://10.1.2.3:")
    assert launch.replay_endpoint == "tcp://10.1.2.3:5558"


def test_a_replay_endpoint_on_a_host_address_is_kept_since_vllm_always_binds_it() -> None:
    args = _kv_events("tcp://*:5557", replay="tcp://10.1.2.3:5558")
    config = parse_config({"pools": POOLS, "workers": [
        {"id": "w", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", "extra_args": args}]})
    assert kv_events_launch(config.workers[0].extra_args, "10.1.2.3", Path("/unused"), 0).replay_endpoint == \
        "tcp://10.1.2.3:5558"


async def test_the_autoscaler_starts_cpu_workers_without_asking_for_gpus(tmp_path: Path) -> None:
    config = parse_config({"pools": POOLS, "autoscale": {"pools": {"chat": {"template": {
        "backend": "vllm", "model_path": "/models/tiny", "kv_cache_gib": 1}}}}})
    started: list[object] = []
    backend = LocalProcessBackend(
        store=None, log_dir=tmp_path, command=lambda spec, port, kv: worker_command(config, spec, port, kv),  # type: ignore[arg-type]
        pools=config.pools, workers=(), settings=ControllerSettings(), placement=PlacementSettings(),
        scaling=config.autoscale.pools, gpu_facts=lambda: {})  # no GPU at all on this node
    backend._start = started.append  # type: ignore[method-assign,assignment]
    assert await backend.launch("chat") == ["chat-w1"]
    spec = started[0]
    cmd, env = worker_command(config, spec, 8001)  # type: ignore[arg-type]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"} and "--gpu-memory-utilization" not in cmd


def test_the_cpu_example_of_the_docs_is_what_the_controller_runs() -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "tiny", "max_model_len": 2048}], "workers": [
        {"id": "cpu", "pool": "chat", "backend": "vllm", "model_path": "/models/tiny", "kv_cache_gib": 2}]})
    command, env = worker_command(config, config.workers[0], 8001)
    line = " ".join([f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}", *command])
    doc = (Path(__file__).resolve().parents[2] / "docs" / "gpu-workers.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", doc, re.M | re.S)
    assert line in [" ".join(block.replace("\\\n", " ").split()) for block in blocks]
