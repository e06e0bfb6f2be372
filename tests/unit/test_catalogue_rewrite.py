"""Per-version parameters (defaults, caps with a 400 naming the limit), the request body rewrite to the served
name (with its content-length), and the public name restored in JSON and SSE responses."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc.assembly import build_service
from extproc.catalogue import Catalogue, Route
from extproc.catalogue_source import CatalogueSource
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.parameters import apply_parameters
from extproc.rename import ModelRenamer
from extproc.scheduling import default_scheduler
from extproc.service import ExtProcService, RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord

NOW = 5000.0
CONFIG = parse_config({
    "pools": [{"name": "chat-a", "model": "chat-v1"}, {"name": "chat-b", "model": "chat-v2"}],
    "catalogue": {"models": [{"name": "chat", "weights": {"v2": 1}, "versions": [
        {"name": "v1", "served_name": "chat-v1"},
        {"name": "v2", "served_name": "chat-v2", "max_model_len": 4096,
         "defaults": {"temperature": 0.2, "max_tokens": 64}, "maximums": {"max_tokens": 1024, "temperature": 1.5}},
    ]}]},
})
V2 = Route("chat", "chat-v2", "v2", defaults={"temperature": 0.2, "max_tokens": 64},
           maximums={"max_tokens": 1024, "temperature": 1.5}, max_model_len=4096)


def test_defaults_fill_only_what_is_missing() -> None:
    data: dict[str, object] = {"model": "chat", "temperature": 0.9}
    assert apply_parameters(data, V2) is True
    assert data == {"model": "chat", "temperature": 0.9, "max_tokens": 64}
    data = {"model": "chat", "temperature": 0.9, "max_completion_tokens": 10}
    assert apply_parameters(data, V2) is False and "max_tokens" not in data


@pytest.mark.parametrize(("asked", "param", "limit"), [
    ({"max_tokens": 2000}, "max_tokens", "limit of 1024 (max_tokens)"),
    ({"max_completion_tokens": 1025}, "max_completion_tokens", "limit of 1024 (max_tokens)"),
    ({"temperature": 1.9}, "temperature", "limit of 1.5 (temperature)"),
])
def test_caps_answer_400_naming_the_limit(asked: dict[str, object], param: str, limit: str) -> None:
    error = apply_parameters({"model": "chat", **asked}, V2)
    assert not isinstance(error, bool)
    assert error.status == 400 and error.param == param and error.code == "parameter_above_limit"
    assert limit in error.message and "'chat' (version v2)" in error.message


def test_max_model_len_caps_the_output_asked() -> None:
    route = Route("chat", "chat-v2", "v2", max_model_len=100)
    error = apply_parameters({"max_tokens": 101}, route)
    assert not isinstance(error, bool) and "(max_model_len)" in error.message
    assert apply_parameters({"max_tokens": 100}, route) is False


def test_renamer_restores_json_and_leaves_other_text_alone() -> None:
    renamer = ModelRenamer("chat-v2", "chat")
    body = b'{"id":"x","model":"chat-v2","choices":[{"text":"say \\"model\\":\\"chat-v2\\" and chat-v2"}]}'
    out = renamer.feed(body, True)
    assert out is not None and orjson.loads(out)["model"] == "chat"
    assert orjson.loads(out)["choices"][0]["text"] == orjson.loads(body)["choices"][0]["text"]
    assert ModelRenamer("chat-v2", "chat").feed(b'{"model": "chat-v2"}', True) == b'{"model": "chat"}'
    assert ModelRenamer("chat-v2", "chat").feed(b'{"model":"chat-v22"}', True) is None


def test_renamer_handles_every_sse_chunk_and_fields_split_across_chunks() -> None:
    events = b"".join(b'data: {"id":"c","model":"chat-v2","choices":[{"delta":{"content":"t%d"}}]}\n\n' % i
                      for i in range(5)) + b"data: [DONE]\n\n"
    for cut in range(1, len(events)):
        renamer = ModelRenamer("chat-v2", "chat")
        first = renamer.feed(events[:cut], False)
        second = renamer.feed(events[cut:], True)
        joined = (events[:cut] if first is None else first) + (events[cut:] if second is None else second)
        assert joined == events.replace(b'"model":"chat-v2"', b'"model":"chat"'), cut


def test_renamer_never_holds_back_a_whole_event() -> None:
    renamer = ModelRenamer("chat-v2", "chat")
    out = renamer.feed(b'data: {"model":"chat-v2"}\n\n', False)
    assert out == b'data: {"model":"chat"}\n\n'
    assert renamer.feed(b'data: {"x":1}\n\n', False) is None


@dataclass
class Fleet:
    snapshot: FleetSnapshot


def service() -> ExtProcService:
    workers = [WorkerRecord(id=f"w-{p}", pool=p, model=m, host="127.0.0.1", port=9000 + i, updated_at=NOW)
               for i, (p, m) in enumerate((("chat-a", "chat-v1"), ("chat-b", "chat-v2")))]
    fleet = Fleet(build_snapshot(workers, CONFIG.pools, taken_at=NOW, stale_after_s=3))
    return build_service(default_scheduler(random.Random(0)), fleet, InflightTracker(), Metrics(),
                         max_request_bytes=1 << 20, clock=lambda: NOW,
                         catalogue=CatalogueSource(Catalogue(CONFIG.catalogue)), rng=random.Random(0))


def headers(method: str, path: str, end: bool = False) -> ProcessingRequest:
    pairs = [(":method", method), (":path", path)]
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end))


def body(data: object) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=orjson.dumps(data), end_of_stream=True))


def test_request_is_rewritten_to_the_served_name_with_its_content_length_and_restored() -> None:
    svc, state = service(), RequestState()
    first = svc.handle(state, headers("POST", "/v1/chat/completions"))
    assert first.mode_override.response_header_mode == first.mode_override.SEND
    routed = svc.handle(state, body({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
    common = routed.request_body.response
    sent = orjson.loads(common.body_mutation.body)
    assert sent["model"] == "chat-v2" and sent["max_tokens"] == 64 and sent["temperature"] == 0.2
    set_headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert set_headers["content-length"] == str(len(common.body_mutation.body)).encode()
    assert set_headers["x-poolgate-cluster"] == b"pool-chat-b"
    response_headers = svc.handle(state, ProcessingRequest(response_headers=HttpHeaders()))
    assert list(response_headers.response_headers.response.header_mutation.remove_headers) == ["content-length"]
    assert response_headers.mode_override.response_body_mode == response_headers.mode_override.STREAMED
    chunk = svc.handle(state, ProcessingRequest(response_body=HttpBody(body=b'{"model":"chat-v2"}',
                                                                       end_of_stream=True)))
    assert chunk.response_body.response.body_mutation.body == b'{"model":"chat"}'
    svc.finish(state)


def test_cap_refusal_is_a_400_immediate_response() -> None:
    svc, state = service(), RequestState()
    svc.handle(state, headers("POST", "/v1/chat/completions"))
    ask = {"model": "chat", "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]}
    answer = svc.handle(state, body(ask))
    assert answer.immediate_response.status.code == 400
    assert b"max_tokens" in answer.immediate_response.body


def test_served_name_asked_directly_is_not_renamed_and_model_list_shows_public_names() -> None:
    svc, state = service(), RequestState()
    svc.handle(state, headers("POST", "/v1/chat/completions"))
    routed = svc.handle(state, body({"model": "chat-v1", "messages": [{"role": "user", "content": "hi"}]}))
    assert not routed.request_body.response.HasField("body_mutation")
    passthrough = svc.handle(state, ProcessingRequest(response_headers=HttpHeaders()))
    assert not passthrough.HasField("mode_override")
    svc.finish(state)
    listing = svc.handle(RequestState(), headers("GET", "/v1/models", end=True))
    ids = [m["id"] for m in orjson.loads(listing.immediate_response.body)["data"]]
    assert ids == ["chat"]
