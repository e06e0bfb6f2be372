"""Prefix caching in the simulated engine as vLLM V1 has it: on by default, counted per new request in
tokens, and reset on demand. Driven by a virtual clock."""

from __future__ import annotations

import argparse

from controller.local_backend import worker_command
from poolgate.kernel.config import parse_config
from simworker import cli
from tests.unit.test_sim_engine import VirtualClock, make_engine, request


def parse_simworker(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_prefix_caching_is_on_by_default_and_can_be_turned_off() -> None:
    assert cli.worker_specs(parse_simworker([]))[0].engine_config().enable_prefix_caching
    assert cli.worker_specs(parse_simworker(["--enable-prefix-caching"]))[0].enable_prefix_caching
    assert not cli.worker_specs(parse_simworker(["--no-enable-prefix-caching"]))[0].enable_prefix_caching


def test_workers_launched_by_the_local_backend_cache_prefixes_unless_told_not_to() -> None:
    config = parse_config({
        "pools": [{"name": "chat", "model": "m", "max_model_len": 4096}],
        "workers": [{"id": "w1", "pool": "chat", "backend": "sim", "preset": "l4-24gb"},
                    {"id": "w2", "pool": "chat", "backend": "sim", "preset": "l4-24gb",
                     "extra_args": ["--no-enable-prefix-caching"]}],
    })
    flags = {}
    for spec in config.workers:
        command, _ = worker_command(config, spec, 8000)
        argv = command[command.index("simworker") + 1:]
        flags[spec.id] = cli.worker_specs(parse_simworker(argv))[0].enable_prefix_caching
    assert flags == {"w1": True, "w2": False}


def test_queries_and_hits_are_counted_in_tokens_on_first_admission() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    shared = tuple(range(1, 11))  # 10 full blocks = 160 tokens
    engine.add_request(request("a", prompt=170, output=3, hashes=shared), now=0.0)
    clock.run_until_idle()
    engine.add_request(request("b", prompt=170, output=3, hashes=shared), now=clock.now)
    clock.run_until_idle()
    assert sum(o.prefix_cache_queries for o in clock.outcomes) == 340
    assert sum(o.prefix_cache_hits for o in clock.outcomes) == 160


def test_a_request_waiting_for_room_is_counted_once_when_admitted() -> None:
    engine = make_engine(num_gpu_blocks=10, block_size=16, max_model_len=160, enable_prefix_caching=True)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=100, output=10), now=0.0)
    engine.add_request(request("b", prompt=100, output=10), now=0.0)
    clock.run_until_idle()
    assert sum(o.prefix_cache_queries for o in clock.outcomes) == 200


def test_readmission_after_preemption_is_not_a_query() -> None:
    # Two 32-token prompts fill 4 of 5 blocks; decoding past 48 tokens preempts "new", which comes back.
    engine = make_engine(num_gpu_blocks=5, block_size=16, max_model_len=80, enable_prefix_caching=True)
    clock = VirtualClock(engine)
    engine.add_request(request("old", prompt=32, output=40, hashes=(1, 2)), now=0.0)
    engine.add_request(request("new", prompt=32, output=40, hashes=(3, 4)), now=0.0)
    clock.run_until_idle()
    assert sum(o.preemptions for o in clock.outcomes) >= 1
    assert sum(o.prefix_cache_queries for o in clock.outcomes) == 64
    assert sum(o.prefix_cache_hits for o in clock.outcomes) == 0


def test_without_prefix_caching_nothing_is_counted() -> None:
    engine = make_engine(enable_prefix_caching=False)
    clock = VirtualClock(engine)
    engine.add_request(request("a", prompt=170, output=2, hashes=tuple(range(10))), now=0.0)
    clock.run_until_idle()
    assert sum(o.prefix_cache_queries for o in clock.outcomes) == 0


def test_reset_forgets_cached_prefixes_of_an_idle_engine() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    shared = tuple(range(1, 11))
    engine.add_request(request("a", prompt=170, output=1, hashes=shared), now=0.0)
    clock.run_until_idle()
    reset = engine.reset_prefix_cache()
    assert reset.done and reset.preemptions == 0
    engine.add_request(request("b", prompt=170, output=1, hashes=shared), now=clock.now)
    outcome = clock.step()
    assert outcome.prefix_cache_hits == 0
    assert outcome.scheduled_tokens == 170


def test_reset_is_refused_while_requests_hold_blocks() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    shared = tuple(range(1, 11))
    engine.add_request(request("a", prompt=170, output=1, hashes=shared), now=0.0)
    clock.run_until_idle()
    engine.add_request(request("long", prompt=40, output=50), now=clock.now)
    clock.step()
    reset = engine.reset_prefix_cache()
    assert not reset.done
    engine.add_request(request("b", prompt=170, output=1, hashes=shared), now=clock.now)
    clock.run_until_idle()
    assert sum(o.prefix_cache_hits for o in clock.outcomes) == 160  # "a"'s prefix survived


def test_reset_with_preemption_recomputes_running_requests_and_succeeds() -> None:
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    clock = VirtualClock(engine)
    engine.add_request(request("x", prompt=40, output=20, hashes=(1, 2)), now=0.0)
    engine.add_request(request("y", prompt=40, output=20, hashes=(3, 4)), now=0.0)
    clock.step()
    clock.step()
    reset = engine.reset_prefix_cache(preempt_running=True)
    assert (reset.done, reset.preemptions) == (True, 2)
    assert (engine.num_running, engine.num_waiting, engine.kv.used_blocks) == (0, 2, 0)
    outcome = clock.step()
    assert outcome.scheduled_tokens == 2 * 42  # both recompute their prompt and their 2 tokens so far
    assert outcome.prefix_cache_queries == 0  # re-admissions, not new requests
    clock.run_until_idle()
    assert clock.finished() == {"x": ("length", 20), "y": ("length", 20)}
    assert sum(o.generation_tokens for o in clock.outcomes) == 40


def test_a_request_admitted_beside_its_prefix_first_reader_shares_it_in_the_same_step() -> None:
    """vLLM V1 caches a block as the step computing it is scheduled, so two questions about one new
    document that arrive together compute the document once."""
    engine = make_engine(enable_prefix_caching=True, block_size=16, max_num_batched_tokens=512)
    clock = VirtualClock(engine)
    document = tuple(range(1, 11))  # 10 full blocks = 160 tokens
    engine.add_request(request("a", prompt=170, output=3, hashes=document), now=0.0)
    engine.add_request(request("b", prompt=170, output=3, hashes=document), now=0.0)
    first = clock.step()
    assert first.scheduled_tokens == 170 + 10
    assert first.prefix_cache_hits == 160
    assert {request_id for request_id, _ in first.first_token_times} == {"a", "b"}


def test_a_request_arriving_while_a_long_prompt_is_chunked_shares_what_is_scheduled() -> None:
    """The document's first 512 tokens run in the first step; the question arriving after it is admitted
    behind the document's last chunk and finds all 62 of its blocks, those that chunk computes included."""
    engine = make_engine(enable_prefix_caching=True, block_size=16, max_num_batched_tokens=512)
    clock = VirtualClock(engine)
    document = tuple(range(1, 63))  # 62 full blocks = 992 tokens
    engine.add_request(request("a", prompt=1000, output=3, hashes=document), now=0.0)
    assert clock.step().scheduled_tokens == 512
    engine.add_request(request("b", prompt=1000, output=3, hashes=document), now=clock.now)
    second = clock.step()
    assert second.prefix_cache_hits == 992
    assert second.scheduled_tokens == 488 + 8
    assert {request_id for request_id, _ in second.first_token_times} == {"a", "b"}
