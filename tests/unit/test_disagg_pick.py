"""The prefill/decode pair over hand-built snapshots (pure), and the pool roles' validation at load."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from extproc.disagg import DisaggPlan, PairDecision, pick_pair
from extproc.request import RequestFacts
from extproc.scheduling import Decision, NoCapacity, PickContext, RequestProfiler, build_scheduler
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import ConfigError, PoolSpec, SchedulingSettings, parse_config
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import DECODE_HEADER, PD_SIDECAR_CLUSTER, PREFILL_HEADER

NOW = 1_000.0
SETTINGS = SchedulingSettings()
POOLS = (PoolSpec(name="pre", model="llama", role="prefill"), PoolSpec(name="dec", model="llama", role="decode"),
         PoolSpec(name="other", model="qwen"))
PLAN = DisaggPlan({"llama": frozenset({"pre"})}, min_prompt_tokens=2048)
PORTS = iter(range(8000, 9000))


def worker(worker_id: str, pool: str, model: str = "llama", **fields: object) -> WorkerRecord:
    values: dict[str, object] = {"updated_at": NOW, "kv_capacity_tokens": 100_000, **fields}
    return WorkerRecord(id=worker_id, pool=pool, model=model, host="10.0.0.1", port=next(PORTS),
                        **values)  # type: ignore[arg-type]


def pair(*workers: WorkerRecord, chars: int = 40_000, model: str = "llama",
         only_pools: frozenset[str] | None = None) -> object:
    facts = RequestFacts("/v1/chat/completions", "POST", model, prompt_chars=chars, message_count=1)
    request = RequestProfiler(SETTINGS).profile(facts)
    if only_pools is not None:
        request = replace(request, only_pools=only_pools)
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {})
    return pick_pair(build_scheduler(SETTINGS, random.Random(0)), request, context, PLAN)


FLEET = (worker("p1", "pre", waiting=3), worker("p2", "pre"), worker("d1", "dec", kv_usage=0.8),
         worker("d2", "dec", kv_usage=0.1))


def test_a_long_prompt_gets_a_pair_each_picked_on_its_own_pool() -> None:
    outcome = pair(*FLEET)
    assert isinstance(outcome, PairDecision)
    assert outcome.prefill.worker_id == "p2"  # p1 has a queue: a later first token
    assert outcome.decode.worker_id == "d2"  # d1 has less KV room
    routed = outcome.routed
    assert routed.cluster == PD_SIDECAR_CLUSTER and routed.worker_id == "d2"
    headers = dict(outcome.headers())
    assert headers[PREFILL_HEADER].split(",")[0] == outcome.prefill.endpoint
    assert headers[DECODE_HEADER].split(",") == [outcome.decode.endpoint, *outcome.decode.fallbacks]


def test_a_short_prompt_is_one_pick_never_on_a_prefill_worker() -> None:
    for _ in range(20):
        outcome = pair(*FLEET, chars=400)
        assert isinstance(outcome, Decision) and outcome.pool == "dec"


def test_no_ready_prefill_worker_serves_the_long_prompt_on_a_decode_worker() -> None:
    down = (worker("p1", "pre", state=WorkerState.FAILED), worker("d1", "dec"))
    outcome = pair(*down)
    assert isinstance(outcome, Decision) and outcome.worker_id == "d1"
    outcome = pair(worker("d1", "dec"), only_pools=frozenset({"dec"}))  # a tenant kept off the prefill pool
    assert isinstance(outcome, Decision) and outcome.worker_id == "d1"


def test_busy_prefill_workers_make_the_request_wait_rather_than_prefill_on_a_decode_worker() -> None:
    outcome = pair(worker("p1", "pre", kv_usage=0.99), worker("d1", "dec"))
    assert isinstance(outcome, NoCapacity)


def test_no_decode_room_is_no_capacity() -> None:
    outcome = pair(worker("p1", "pre"), worker("d1", "dec", kv_usage=0.99))
    assert isinstance(outcome, NoCapacity)


def test_models_without_prefill_pools_are_picked_as_before() -> None:
    outcome = pair(worker("q1", "other", model="qwen"), model="qwen")
    assert isinstance(outcome, Decision) and outcome.worker_id == "q1"


def test_plan_from_config_and_role_validation() -> None:
    base = {"pools": [{"name": "pre", "model": "m", "role": "prefill"},
                      {"name": "dec", "model": "m", "role": "decode"}],
            "disaggregation": {"min_prompt_tokens": 4096}}
    plan = DisaggPlan.from_config(parse_config(base))
    assert plan == DisaggPlan({"m": frozenset({"pre"})}, 4096)
    assert DisaggPlan.from_config(parse_config({"pools": [{"name": "a", "model": "m"}]})) is None
    with pytest.raises(ConfigError, match=r"pools\.0\.role.*no decode pool"):
        parse_config({"pools": [{"name": "pre", "model": "m", "role": "prefill"}]})
    with pytest.raises(ConfigError, match=r"pools\.0\.role.*task 'generate'"):
        parse_config({"pools": [{"name": "e", "model": "m", "role": "decode", "task": "embed"}]})
    with pytest.raises(ConfigError, match=r"role"):
        parse_config({"pools": [{"name": "x", "model": "m", "role": "prefil"}]})


def test_local_workers_start_with_their_pools_kv_role() -> None:
    from controller.local_backend import worker_command

    config = parse_config({
        "pools": [{"name": "pre", "model": "m", "role": "prefill"}, {"name": "dec", "model": "m", "role": "decode"}],
        "workers": [{"id": "p", "pool": "pre"}, {"id": "d", "pool": "dec", "backend": "vllm", "model_path": "x"},
                    {"id": "own", "pool": "dec", "extra_args": ["--kv-transfer-config", '{"kv_role": "kv_both"}']}]})
    commands = [worker_command(config, spec, 9000)[0] for spec in config.workers]
    flags = [cmd[cmd.index("--kv-transfer-config") + 1] for cmd in commands]
    assert flags == ['{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
                     '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}', '{"kv_role": "kv_both"}']
    assert commands[1][:2] == ["vllm", "serve"]
