"""The servicer's per-message answers, driven without gRPC: what Envoy receives for each kind of request."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.assembly import build_service
from extproc.flow_queue import FlowQueue
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.pipeline import DECISION_HEADER, CapacitySignal
from extproc.reservations import ReservationBook
from extproc.scheduling import default_scheduler
from extproc.service import ExtProcService, Phase, RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE, ROUTING_HEADERS

NOW = 5000.0
POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))
LIMIT = 64 * 1024


@dataclass
class Fleet:
    snapshot: FleetSnapshot


class Rig:
    """The servicer as Envoy drives it, with the director's queue and reservations in view."""

    def __init__(self, servicer: ExtProcService) -> None:
        self.servicer = servicer
        director = servicer.director
        self.queue: FlowQueue = director.hold_stage.queue
        self.reservations: ReservationBook = director.place.reservations
        self.capacity_changed: CapacitySignal = director.hold_stage.capacity_changed

    def handle(self, state: RequestState, message: ProcessingRequest) -> ProcessingResponse:
        return self.servicer.handle(state, message)

    async def hold(self, state: RequestState) -> ProcessingResponse:
        return await self.servicer.hold(state)

    def finish(self, state: RequestState) -> None:
        self.servicer.finish(state)


def rig(*args: Any, **parts: Any) -> Rig:
    """``build_service`` with ``clock`` at ``NOW`` unless given."""
    return Rig(build_service(*args, **{"clock": lambda: NOW, **parts}))


def make_service(*workers: WorkerRecord, settings: SchedulingSettings | None = None) -> (
        tuple[Rig, InflightTracker, Metrics]):
    settings = settings or SchedulingSettings()
    fleet = Fleet(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3))
    tracker, metrics = InflightTracker(), Metrics()
    service = rig(default_scheduler(random.Random(0), settings), fleet, tracker, metrics, max_request_bytes=LIMIT,
                  scheduling=settings)
    return service, tracker, metrics


def ready(worker_id: str, port: int, pool: str = "chat") -> WorkerRecord:
    model = "llama" if pool == "chat" else "coder"
    return WorkerRecord(id=worker_id, pool=pool, model=model, host="127.0.0.1", port=port, updated_at=NOW)


def headers(method: str, path: str, end: bool = False, extra: dict[str, str] | None = None,
            **named: str) -> ProcessingRequest:
    extra = {**(extra or {}), **named}
    pairs = [(":method", method), (":path", path), (":authority", "gw"), *extra.items()]
    values = [HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in pairs]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end))


def body(data: object) -> ProcessingRequest:
    raw = data if isinstance(data, bytes) else orjson.dumps(data)
    return ProcessingRequest(request_body=HttpBody(body=raw, end_of_stream=True))


CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}


def exchange(service: Rig, *messages: ProcessingRequest) -> list[ProcessingResponse]:
    state = RequestState()
    answers = [service.handle(state, m) for m in messages]
    service.finish(state)
    return answers


def test_routed_request_sets_cluster_header_clears_route_cache_and_pins_endpoint() -> None:
    service, tracker, _ = make_service(ready("w1", 9001))
    state = RequestState()
    first = service.handle(state, headers("POST", "/v1/chat/completions", extra={CLUSTER_HEADER: "pool-x",
                                                                            DESTINATION_ENDPOINT_KEY: "6.6.6.6:1",
                                                                            "x-poolgate-tenant": "root"}))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    second = service.handle(state, body(CHAT))
    common = second.request_body.response
    assert common.clear_route_cache
    [set_header] = common.header_mutation.set_headers
    assert (set_header.header.key, set_header.header.raw_value, set_header.header.value) == (
        CLUSTER_HEADER, b"pool-chat", "")
    assert set(common.header_mutation.remove_headers) == {"authorization", DESTINATION_ENDPOINT_KEY,
                                                          "x-poolgate-tenant"}
    pin = second.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT_KEY]
    assert pin.string_value == "127.0.0.1:9001"
    assert tracker.counts == {"w1": 1}
    service.finish(state)
    assert tracker.counts == {"w1": 0}


def test_passthrough_paths_only_lose_routing_headers() -> None:
    service, tracker, _ = make_service(ready("w1", 9001))
    [get] = exchange(service, headers("GET", "/health", end=True, extra={ROUTING_HEADERS[-1]: "x"}))
    assert list(get.request_headers.response.header_mutation.remove_headers) == [ROUTING_HEADERS[-1]]
    _, post = exchange(service, headers("POST", "/custom/hook"), body({"model": "llama", "input": "x"}))
    assert post.WhichOneof("response") == "request_body"
    assert not post.request_body.response.clear_route_cache and not post.HasField("dynamic_metadata")
    assert tracker.counts == {}


def test_model_list_is_answered_at_the_headers_phase() -> None:
    service, _, metrics = make_service(ready("w1", 9001, "code"))
    [answer] = exchange(service, headers("GET", "/v1/models", end=True))
    reply = answer.immediate_response
    assert reply.status.code == 200
    listed = orjson.loads(reply.body)
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["llama", "coder"]
    assert all(m["object"] == "model" and m["created"] == int(NOW) for m in listed["data"])
    assert metrics.registry.get_sample_value("poolgate_extproc_requests_total", {"outcome": "model_list"}) == 1


@pytest.mark.parametrize(("messages", "status", "code"), [
    ((headers("POST", "/v1/chat/completions", content_length=str(LIMIT + 1)),), 413, "request_too_large"),
    ((headers("POST", "/v1/chat/completions"), body(b"x" * (LIMIT + 1))), 413, "request_too_large"),
    ((headers("POST", "/v1/chat/completions", end=True),), 400, "missing_body"),
    ((headers("POST", "/v1/chat/completions"), body(b"{oops")), 400, "invalid_json"),
    ((headers("POST", "/v1/chat/completions"), body({**CHAT, "model": "gpt-9"})), 404, "model_not_found"),
    ((headers("POST", "/v1/completions"), body({"model": "coder", "prompt": "x"})), 503, "no_ready_worker"),
])
def test_errors_become_immediate_json(messages: tuple[ProcessingRequest, ...], status: int, code: str) -> None:
    service, tracker, metrics = make_service(ready("w1", 9001),
                                             ready("c1", 9002, "code").with_live(state=WorkerState.DRAINING))
    answer = exchange(service, *messages)[-1]
    assert answer.immediate_response.status.code == status
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == code
    assert metrics.registry.get_sample_value("poolgate_extproc_requests_total", {"outcome": code}) == 1
    assert tracker.counts == {}


def test_unexpected_exception_is_a_500_answer_and_a_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    service, tracker, metrics = make_service(ready("w1", 9001))

    def explode(*args: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(service.servicer.director.place.scheduler, "pick", explode)
    _, answer = exchange(service, headers("POST", "/v1/chat/completions"), body(CHAT))
    assert answer.immediate_response.status.code == 500
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "internal_error"
    assert metrics.registry.get_sample_value("poolgate_extproc_internal_errors_total") == 1
    assert tracker.counts == {}


def test_body_without_headers_is_a_500_not_a_crash() -> None:
    service, _, _ = make_service()
    [answer] = exchange(service, body(CHAT))
    assert answer.immediate_response.status.code == 500


def kv_worker(worker_id: str, port: int, usage: float, capacity: int = 10_000) -> WorkerRecord:
    return ready(worker_id, port).with_live(kv_capacity_tokens=capacity, kv_usage=usage)


LONG_CHAT = {"model": "llama", "max_tokens": 100, "messages": [{"role": "user", "content": "word " * 2000}]}
"""About 2500 + 100 tokens: fits in an empty 10 000-token worker, not in one at 80 % usage."""


def body_answer(service: Rig, state: RequestState, data: object = LONG_CHAT) -> ProcessingResponse:
    service.handle(state, headers("POST", "/v1/chat/completions"))
    return service.handle(state, body(data))


def error_of(answer: ProcessingResponse) -> tuple[int, str, dict[str, bytes]]:
    reply = answer.immediate_response
    sent = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    return reply.status.code, orjson.loads(reply.body)["error"]["code"], sent


def test_no_capacity_without_waiting_is_429_with_retry_after() -> None:
    service, tracker, metrics = make_service(kv_worker("w1", 9001, 0.8),
                                             settings=SchedulingSettings(max_wait_s=0, retry_after_s=3))
    state = RequestState()
    status, code, sent = error_of(body_answer(service, state))
    assert (status, code, sent["retry-after"]) == (429, "no_capacity", b"3")
    assert tracker.counts == {}
    assert metrics.registry.get_sample_value("poolgate_extproc_pick_refusals_total",
                                             {"model": "llama", "reason": "kv-fits"}) == 1


async def test_held_request_is_refused_after_the_bounded_wait() -> None:
    service, tracker, metrics = make_service(kv_worker("w1", 9001, 0.8), settings=SchedulingSettings(max_wait_s=0.3))
    state = RequestState()
    first = body_answer(service, state)
    assert first.HasField("override_message_timeout") and first.WhichOneof("response") is None
    assert first.override_message_timeout.ToTimedelta().total_seconds() == pytest.approx(2.3)
    assert state.phase is Phase.HELD
    started = time.perf_counter()
    status, code, sent = error_of(await service.hold(state))
    assert 0.3 <= time.perf_counter() - started < 1.0
    assert (status, code, sent["retry-after"]) == (429, "no_capacity", b"1")
    assert tracker.counts == {} and service.reservations.kv_tokens == {}
    assert metrics.registry.get_sample_value("poolgate_extproc_hold_seconds_count", {"outcome": "refused"}) == 1
    assert metrics.registry.get_sample_value("poolgate_extproc_held_requests") == 0


async def test_held_request_is_placed_when_the_fleet_shows_room() -> None:
    service, tracker, metrics = make_service(kv_worker("w1", 9001, 0.8), settings=SchedulingSettings(max_wait_s=5))
    state = RequestState()
    body_answer(service, state)
    held = asyncio.create_task(service.hold(state))
    await asyncio.sleep(0.05)
    assert not held.done()
    fleet = service.servicer.director.place.fleet
    assert isinstance(fleet, Fleet)
    fleet.snapshot = build_snapshot([kv_worker("w1", 9001, 0.1)], POOLS, taken_at=NOW, stale_after_s=3)
    service.capacity_changed.notify()
    answer = await asyncio.wait_for(held, 1)
    assert answer.request_body.response.clear_route_cache and tracker.counts == {"w1": 1}
    assert metrics.registry.get_sample_value("poolgate_extproc_hold_seconds_count", {"outcome": "placed"}) == 1


async def test_held_request_is_placed_when_an_earlier_one_ends() -> None:
    """Reservations: the first request's footprint counts before the record shows it, so the second waits for
    it to end instead of landing on a worker that is about to be full."""
    service, tracker, _ = make_service(kv_worker("w1", 9001, 0.5), settings=SchedulingSettings(max_wait_s=5))
    first, second = RequestState(), RequestState()
    assert body_answer(service, first).request_body.response.clear_route_cache
    assert service.reservations.kv_tokens["w1"] > 2500
    assert body_answer(service, second).HasField("override_message_timeout")
    held = asyncio.create_task(service.hold(second))
    await asyncio.sleep(0.05)
    assert not held.done()
    service.finish(first)
    answer = await asyncio.wait_for(held, 1)
    assert answer.request_body.response.clear_route_cache and tracker.counts == {"w1": 1}
    service.finish(second)
    assert service.reservations.kv_tokens == {} and tracker.counts == {"w1": 0}


@pytest.mark.parametrize("enabled", [True, False])
def test_debug_header(enabled: bool) -> None:
    service, _, metrics = make_service(kv_worker("w1", 9001, 0.1), settings=SchedulingSettings(debug_header=enabled))
    _, answer = exchange(service, headers("POST", "/v1/chat/completions"), body(CHAT))
    sent = {h.header.key: h.header.raw_value.decode()
            for h in answer.request_body.response.header_mutation.set_headers}
    assert (DECISION_HEADER in sent) == enabled
    if enabled:
        value = sent[DECISION_HEADER]
        assert value.startswith("worker=w1 pool=chat class=short_chat prompt_tokens=9 output_tokens=256 ")
        assert "latency=1.000" in value
    assert metrics.registry.get_sample_value("poolgate_extproc_picks_total", {"pool": "chat", "worker": "w1"}) == 1


SESSION_TURN = {"model": "llama", "messages": [
    {"role": "system", "content": "You answer questions about the attached report. " * 60},
    {"role": "user", "content": "What changed in the second quarter?"}]}
"""A conversation whose history (~2,400 characters) the session's worker holds: worth more than a few requests
in flight there."""


def test_session_requests_follow_their_worker() -> None:
    now = [NOW]
    settings = SchedulingSettings()
    fleet = Fleet(build_snapshot([ready("a", 9001), ready("b", 9002)], POOLS, taken_at=NOW, stale_after_s=3))
    service = rig(default_scheduler(random.Random(0), settings), fleet, InflightTracker(), Metrics(),
                  max_request_bytes=LIMIT, scheduling=settings, clock=lambda: now[0])
    state = RequestState()
    service.handle(state, headers("POST", "/v1/chat/completions", x_session_id="s1"))
    first = pin_of(service.handle(state, body(SESSION_TURN)))
    for _ in range(5):  # the first requests are still in flight: balance alone would alternate
        now[0] += 1.0  # their prefill is done; their streams go on
        other = RequestState()
        service.handle(other, headers("POST", "/v1/chat/completions", x_session_id="s1"))
        assert pin_of(service.handle(other, body(SESSION_TURN))) == first


def pin_of(answer: ProcessingResponse) -> str:
    fields = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    return fields[DESTINATION_ENDPOINT_KEY].string_value.split(",")[0]
