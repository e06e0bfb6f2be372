"""The servicer's per-message answers, driven without gRPC: what Envoy receives for each kind of request."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.scheduling import default_scheduler
from extproc.service import ExtProcService, RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.config import PoolSpec
from poolgate.fleet import WorkerRecord, WorkerState
from poolgate.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE, ROUTING_HEADERS

NOW = 5000.0
POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))
LIMIT = 64 * 1024


@dataclass
class Fleet:
    snapshot: FleetSnapshot


def make_service(*workers: WorkerRecord) -> tuple[ExtProcService, InflightTracker, Metrics]:
    fleet = Fleet(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3))
    tracker, metrics = InflightTracker(), Metrics()
    service = ExtProcService(default_scheduler(random.Random(0)), fleet, tracker, LIMIT, metrics,
                             clock=lambda: NOW)
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


def exchange(service: ExtProcService, *messages: ProcessingRequest) -> list[ProcessingResponse]:
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
    assert set(common.header_mutation.remove_headers) == {DESTINATION_ENDPOINT_KEY, "x-poolgate-tenant"}
    pin = second.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT_KEY]
    assert pin.string_value == "127.0.0.1:9001"
    assert tracker.counts == {"w1": 1}
    service.finish(state)
    assert tracker.counts == {"w1": 0}


def test_passthrough_paths_only_lose_routing_headers() -> None:
    service, tracker, _ = make_service(ready("w1", 9001))
    [get] = exchange(service, headers("GET", "/health", end=True, extra={ROUTING_HEADERS[-1]: "x"}))
    assert list(get.request_headers.response.header_mutation.remove_headers) == [ROUTING_HEADERS[-1]]
    _, post = exchange(service, headers("POST", "/v1/embeddings"), body({"model": "llama", "input": "x"}))
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

    monkeypatch.setattr(service._scheduler, "pick", explode)
    _, answer = exchange(service, headers("POST", "/v1/chat/completions"), body(CHAT))
    assert answer.immediate_response.status.code == 500
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "internal_error"
    assert metrics.registry.get_sample_value("poolgate_extproc_internal_errors_total") == 1
    assert tracker.counts == {}


def test_body_without_headers_is_a_500_not_a_crash() -> None:
    service, _, _ = make_service()
    [answer] = exchange(service, body(CHAT))
    assert answer.immediate_response.status.code == 500
