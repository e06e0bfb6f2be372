"""Scale to zero in extproc: a request for an empty pool that may scale to zero waits in the queue (counted for
the pool, where the autoscaler reads it) and is placed once a worker is Ready; past the pool's cold-start wait
it gets 503 with Retry-After. Pools that cannot scale to zero answer 503 at once."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import pytest

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.pipeline.cold_start import ENDPOINT_SETTLE_S, ColdStarts
from extproc.request import RequestFacts
from extproc.scheduling import PickRequest, default_scheduler
from extproc.service import Phase, RequestState
from extproc.snapshot import build_snapshot
from extproc.watcher import held_per_pool
from poolgate.kernel.config import AutoscaleSettings, PoolSpec, SchedulingSettings, parse_config
from poolgate.kernel.routing import QUEUE_WAIT_HEADER
from tests.unit.test_extproc_service import CHAT, LIMIT, NOW, Fleet, Rig, body_answer, error_of, ready, rig

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))


def autoscale(**pools: dict[str, object]) -> AutoscaleSettings:
    config = parse_config({"pools": [p.model_dump() for p in POOLS],
                           "autoscale": {"enabled": True, "pools": pools}})
    return config.autoscale


def cold_rig(*workers: object, wait_s: float = 30.0, max_wait_s: float = 5.0,
             scaling: AutoscaleSettings | None = None) -> tuple[Rig, Fleet, Metrics]:
    scaling = scaling or autoscale(chat={"min_workers": 0, "max_workers": 2, "cold_start_wait_s": wait_s})
    settings = SchedulingSettings(max_wait_s=max_wait_s)
    fleet = Fleet(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3))  # type: ignore[arg-type]
    metrics = Metrics()
    service = rig(default_scheduler(random.Random(0), settings), fleet, InflightTracker(), metrics,
                  max_request_bytes=LIMIT, scheduling=settings, cold_starts=ColdStarts.from_config(POOLS, scaling))
    return service, fleet, metrics


def request(model: str = "llama", only: frozenset[str] | None = None,
            excluded: frozenset[str] = frozenset()) -> PickRequest:
    return PickRequest(RequestFacts("/v1/chat/completions", "POST", model), 4, 4, 16, "short_chat",
                       only_pools=only, excluded_pools=excluded)


def test_only_pools_with_min_workers_0_under_enabled_autoscaling_may_wake() -> None:
    scaling = autoscale(chat={"min_workers": 0, "cold_start_wait_s": 45}, code={"min_workers": 1})
    cold = ColdStarts.from_config(POOLS, scaling)
    empty = build_snapshot([], POOLS, taken_at=NOW, stale_after_s=3)
    assert cold.wait_s(request("llama"), empty) == 45
    assert cold.wait_s(request("coder"), empty) is None  # min_workers 1: never empty on purpose
    off = AutoscaleSettings.model_validate({**scaling.model_dump(), "enabled": False})
    assert not ColdStarts.from_config(POOLS, off)


def test_a_ready_worker_or_a_tenant_restriction_means_no_cold_start() -> None:
    cold = ColdStarts({"llama": {"chat": 20.0, "spare": 60.0}})
    empty = build_snapshot([], POOLS, taken_at=NOW, stale_after_s=3)
    assert cold.wait_s(request(), empty) == 60.0  # the longest of the pools it may use
    assert cold.wait_s(request(only=frozenset({"chat"})), empty) == 20.0
    assert cold.wait_s(request(excluded=frozenset({"chat", "spare"})), empty) is None
    serving = build_snapshot([ready("w1", 9001)], POOLS, taken_at=NOW, stale_after_s=3)
    assert cold.wait_s(request(), serving) is None  # a worker is Ready: wait for capacity like any request
    assert cold.wait_s(request(excluded=frozenset({"chat"})), serving) == 60.0  # not one it may use


async def test_request_for_an_empty_pool_waits_and_is_served_when_a_worker_is_ready() -> None:
    service, fleet, metrics = cold_rig(wait_s=30.0, max_wait_s=0)  # the class holds for capacity not at all
    state = RequestState()
    first = body_answer(service, state, CHAT)
    assert state.phase is Phase.HELD
    assert first.override_message_timeout.ToTimedelta().total_seconds() == pytest.approx(32.0)
    held = held_per_pool(service.queue.held_by_domain(), POOLS)
    assert held == {"chat": 1, "code": 0}  # what the watcher publishes for the autoscaler
    waiting = asyncio.create_task(service.hold(state))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    just_registered = replace(ready("chat-w1", 9001), registered_at=NOW)
    fleet.snapshot = build_snapshot([just_registered], POOLS, taken_at=NOW, stale_after_s=3)
    service.capacity_changed.notify()
    await asyncio.sleep(0.3)
    assert not waiting.done(), "Envoy may not know the new endpoint yet: its empty cluster would answer 503"
    settled = replace(just_registered, registered_at=NOW - ENDPOINT_SETTLE_S)
    fleet.snapshot = build_snapshot([settled], POOLS, taken_at=NOW, stale_after_s=3)
    answer = await asyncio.wait_for(waiting, 2)  # the hold's own poll finds it
    mutation = answer.request_body.response
    assert mutation.clear_route_cache
    sent = {h.header.key: h.header.raw_value for h in mutation.header_mutation.set_headers}
    assert int(sent[QUEUE_WAIT_HEADER]) >= 600
    assert metrics.registry.get_sample_value("poolgate_extproc_cold_start_wait_seconds_count",
                                             {"model": "llama", "outcome": "placed"}) == 1
    assert len(service.queue) == 0


async def test_cold_start_past_its_wait_is_503_with_retry_after() -> None:
    service, _, metrics = cold_rig(wait_s=0.3)
    state = RequestState()
    body_answer(service, state, CHAT)
    started = time.perf_counter()
    status, code, sent = error_of(await service.hold(state))
    assert 0.3 <= time.perf_counter() - started < 2.0
    assert (status, code, sent["retry-after"]) == (503, "cold_start_timeout", b"10")
    assert metrics.registry.get_sample_value("poolgate_extproc_cold_start_wait_seconds_count",
                                             {"model": "llama", "outcome": "refused"}) == 1
    assert metrics.registry.get_sample_value("poolgate_extproc_rejections_total",
                                             {"tenant": "default", "reason": "cold_start_timeout"}) == 1


def test_a_pool_that_cannot_scale_to_zero_answers_503_at_once() -> None:
    service, _, _ = cold_rig(scaling=autoscale(chat={"min_workers": 1}))
    state = RequestState()
    status, code, _ = error_of(body_answer(service, state, CHAT))
    assert (status, code) == (503, "no_ready_worker") and len(service.queue) == 0


def test_a_request_placed_at_once_carries_no_wait_header() -> None:
    service, _, _ = cold_rig(ready("chat-w1", 9001))
    answer = body_answer(service, RequestState(), CHAT)
    sent = {h.header.key for h in answer.request_body.response.header_mutation.set_headers}
    assert QUEUE_WAIT_HEADER not in sent
