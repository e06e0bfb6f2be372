"""The simulated engine reports KV-cache changes when its cache really changes, as vLLM's block pool does:
blocks stored once computed, evictions when an allocation needs their room, a reset that succeeded."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from simworker import cli
from simworker.driver import EngineDriver
from simworker.engine import Engine, EngineConfig, EngineRequest
from simworker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventRecorder
from simworker.kv_publisher import KVEventsConfig
from simworker.metrics import WorkerMetrics
from tests.unit.test_sim_engine import COST, VirtualClock


def engine_with_events(num_gpu_blocks: int = 100) -> tuple[Engine, KVEventRecorder]:
    recorder = KVEventRecorder(block_size=4)
    engine = Engine(EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=4, max_num_seqs=8,
                                 max_num_batched_tokens=64, max_model_len=40, enable_prefix_caching=True,
                                 cost=COST), recorder)
    return engine, recorder


def prompt(request_id: str, first_token: int, blocks: int, output: int = 2) -> EngineRequest:
    token_ids = tuple(range(first_token, first_token + blocks * 4 + 1))
    hashes = tuple(first_token * 1000 + i for i in range(blocks))
    return EngineRequest(request_id, len(token_ids), output, "length", hashes, token_ids)


def run(engine: Engine, recorder: KVEventRecorder, *requests: EngineRequest) -> list[KVEvent]:
    clock = VirtualClock(engine)
    for item in requests:
        engine.add_request(item, now=clock.now)
    clock.run_until_idle()
    return recorder.take()


def test_computed_prompt_blocks_are_stored_with_their_parent_and_tokens() -> None:
    engine, recorder = engine_with_events()
    events = run(engine, recorder, prompt("a", 1, blocks=3))
    assert events == [BlockStored((1000, 1001, 1002), None, tuple(range(1, 13)), 4)]
    assert run(engine, recorder, prompt("b", 1, blocks=3)) == []  # a cache hit stores nothing new


def test_an_allocation_that_evicts_cached_blocks_reports_them_removed() -> None:
    engine, recorder = engine_with_events(num_gpu_blocks=10)
    run(engine, recorder, prompt("a", 1, blocks=8))
    events = run(engine, recorder, prompt("b", 500, blocks=8))
    removed = [h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes]
    assert removed and set(removed) <= {1000 + i for i in range(8)}
    assert removed == sorted(removed, reverse=True)  # a released prefix is evicted tail first, as vLLM frees it


def test_a_reset_that_succeeds_clears_all_blocks_and_a_refused_one_reports_nothing() -> None:
    engine, recorder = engine_with_events()
    run(engine, recorder, prompt("a", 1, blocks=2))
    engine.add_request(prompt("b", 50, blocks=2), now=100.0)
    engine.step(100.0)
    recorder.take()
    assert not engine.reset_prefix_cache().done
    assert recorder.take() == []
    assert engine.reset_prefix_cache(preempt_running=True).done
    assert recorder.take() == [AllBlocksCleared()]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_takes_vllms_json_and_offsets_ports_per_worker() -> None:
    args = parse(["--ports", "8000", "8001", "--kv-events-config",
                  '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",'
                  ' "topic": "kv", "buffer_steps": 100}'])
    first, second = (spec.kv_events for spec in cli.worker_specs(args))
    assert first.publishes and first.endpoint == "tcp://*:5557" and first.topic == "kv"
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5558", "tcp://*:5559")
    assert not cli.worker_specs(parse([]))[0].kv_events.publishes
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


@pytest.mark.parametrize("text", ['{"enable_kv_cache_events": true, "endpont": "x"}', '{"hwm": "many"}',
                                  '{"publisher": "kafka"}', "[1]", "{"])
def test_a_bad_kv_events_config_is_refused_with_the_field_named(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--kv-events-config", text])
    assert "--kv-events-config" in capsys.readouterr().err


def test_workers_the_local_backend_starts_publish_where_their_record_says(tmp_path: object) -> None:
    from pathlib import Path

    from controller.kv_events_launch import kv_events_launch, kv_socket_path
    from controller.local_backend import worker_command
    from poolgate.kernel.config import parse_config

    config = parse_config({"pools": [{"name": "chat", "model": "m"}],
                           "workers": [{"id": "w1", "pool": "chat", "backend": "sim", "preset": "l4-24gb"}]})
    launch = kv_events_launch((), "127.0.0.1", kv_socket_path(Path(str(tmp_path)), "w1"), 7001)
    command, _ = worker_command(config, config.workers[0], 8000, launch)
    spec = cli.worker_specs(parse(command[command.index("simworker") + 1:]))[0]
    assert spec.kv_events.publishes
    assert (spec.kv_events.endpoint, spec.kv_events.replay_endpoint) == (launch.endpoint, launch.replay_endpoint)
    assert launch.endpoint.startswith("ipc://") and launch.replay_endpoint == "tcp://127.0.0.1:7001"
    given = kv_events_launch(("--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'),
                             "10.0.0.5", Path("unused"), 1)
    assert (given.args, given.endpoint, given.replay_endpoint) == ((), "tcp://10.0.0.5:5557", "")


def test_kubernetes_workers_publish_as_their_manifest_says_and_their_records_follow() -> None:
    from pathlib import Path

    import yaml

    from controller.kube_backend import _kv_events_endpoints

    root = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
    for name in ("worker-chat.yaml", "worker-code.yaml"):
        template = yaml.safe_load((root / name).read_text())["spec"]["template"]
        args = template["spec"]["containers"][0]["args"]
        events = KVEventsConfig.from_json(args[args.index("--kv-events-config") + 1])
        annotations = template["metadata"]["annotations"]
        assert events.publishes
        assert _kv_events_endpoints("10.1.0.7", annotations) == {
            "kv_events_endpoint": f"tcp://10.1.0.7:{events.endpoint.rpartition(':')[2]}",
            "kv_events_replay_endpoint": f"tcp://10.1.0.7:{(events.replay_endpoint or '').rpartition(':')[2]}"}
    assert _kv_events_endpoints("10.1.0.7", {"poolgate.io/port": "8000"}) == {}


def test_the_socket_a_launch_chose_is_removed_and_a_given_endpoint_left_alone(tmp_path: Path) -> None:
    """A killed engine leaves its ipc socket file behind: the backend removes the one it chose once the process
    ended, never a path the operator configured."""
    from controller.kv_events_launch import kv_events_launch

    chosen = tmp_path / "w1.sock"
    chosen.touch()
    kv_events_launch((), "127.0.0.1", chosen, 7001).remove_socket()
    assert not chosen.exists()
    theirs = tmp_path / "theirs.sock"
    theirs.touch()
    config = '{"enable_kv_cache_events": true, "endpoint": "ipc://' + str(theirs) + '"}'
    kv_events_launch(("--kv-events-config", config), "127.0.0.1", chosen, 7001).remove_socket()
    assert theirs.exists()
    kv_events_launch((), "127.0.0.1", chosen, 7001).remove_socket()  # already gone: nothing to do


async def test_a_steps_blocks_are_published_once_the_step_is_done() -> None:
    """The engine records a prompt's blocks as their step is scheduled; like vLLM, the worker puts them on
    the wire only when that step has run, even if a request arrives while it runs."""
    engine, recorder = engine_with_events()
    published: list[KVEvent] = []
    time_scale = 0.1  # the first step (~11 model ms) takes ~110 ms here
    driver = EngineDriver(engine, WorkerMetrics("m", {}, 1e9, False, time_scale), time_scale=time_scale,
                          flush_kv_events=lambda: published.extend(recorder.take()))

    def stored() -> list[KVEvent]:
        return [event for event in published if isinstance(event, BlockStored)]

    running = asyncio.create_task(driver.run())
    try:
        driver.submit(prompt("a", 1, blocks=2))
        await asyncio.sleep(0.03)
        driver.submit(prompt("b", 100, blocks=1))
        assert not stored()
        for _ in range(100):
            if stored():
                break
            await asyncio.sleep(0.02)
        assert stored()
    finally:
        driver.kill()
        await asyncio.wait_for(running, 5)
