"""The new endpoints through the servicer, driven without gRPC: routed by their model to a pool of the right
kind, with the catalogue's names, their usage read, and unknown paths answered 404 by extproc itself."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest, ProcessingResponse

from extproc.assembly import build_service
from extproc.catalogue import Catalogue
from extproc.catalogue_source import CatalogueSource
from extproc.genai import GenAiCall
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.scheduling import default_scheduler
from extproc.service import ExtProcService, RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from extproc.usage import UsageWatch
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import CLUSTER_HEADER
from tests.unit.test_extproc_service import body, headers

NOW = 5000.0
CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "llama"}, {"name": "embed", "model": "bge-m3", "task": "embed"},
              {"name": "rerank", "model": "bge-reranker", "task": "score"},
              {"name": "speech", "model": "whisper", "task": "transcription"}],
    "catalogue": {"models": [{"name": "embedder", "versions": [{"name": "v1", "served_name": "bge-m3"}]},
                             {"name": "stt", "versions": [{"name": "v1", "served_name": "whisper"}]}]},
})
WORKERS = {"chat": "llama", "embed": "bge-m3", "rerank": "bge-reranker", "speech": "whisper"}


@dataclass
class Fleet:
    snapshot: FleetSnapshot


def service() -> tuple[ExtProcService, InflightTracker]:
    records = [WorkerRecord(id=f"{pool}-1", pool=pool, model=model, host="127.0.0.1", port=9000 + i, updated_at=NOW)
               for i, (pool, model) in enumerate(WORKERS.items())]
    fleet = Fleet(build_snapshot(records, CONFIG.pools, taken_at=NOW, stale_after_s=3))
    tracker = InflightTracker()
    built = build_service(default_scheduler(random.Random(0)), fleet, tracker, Metrics(), max_request_bytes=1 << 20,
                          catalogue=CatalogueSource(Catalogue(CONFIG.catalogue)), clock=lambda: NOW,
                          model_tasks={pool.model: pool.task for pool in CONFIG.pools})
    return built, tracker


def send(svc: ExtProcService, method: str, path: str, payload: object = None,
         content_type: str = "application/json") -> ProcessingResponse:
    state = RequestState()
    first = svc.handle(state, headers(method, path, end=payload is None, content_type=content_type))
    answer = first if payload is None else svc.handle(state, body(payload))
    svc.finish(state)
    return answer


def cluster(answer: ProcessingResponse) -> str:
    assert answer.WhichOneof("response") == "request_body", answer
    mutation = answer.request_body.response.header_mutation
    return next(h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == CLUSTER_HEADER)


def error(answer: ProcessingResponse) -> tuple[int, dict[str, object]]:
    reply = answer.immediate_response
    return reply.status.code, orjson.loads(reply.body)["error"]


@pytest.mark.parametrize(("path", "payload", "pool"), [
    ("/v1/responses", {"model": "llama", "input": "hi"}, "chat"),
    ("/v1/embeddings", {"model": "bge-m3", "input": ["a", "b"]}, "embed"),
    ("/v1/embeddings", {"model": "embedder", "input": "a"}, "embed"),  # a catalogue name
    ("/score", {"model": "bge-reranker", "text_1": "q", "text_2": ["a"]}, "rerank"),
    ("/v1/score", {"model": "bge-m3", "text_1": "q", "text_2": "a"}, "embed"),  # embedding models score too
    ("/v2/rerank", {"model": "bge-reranker", "query": "q", "documents": ["a", "b"]}, "rerank"),
    ("/tokenize", {"model": "whisper", "prompt": "hello"}, "speech"),
    ("/detokenize", {"model": "bge-m3", "tokens": [1, 2]}, "embed"),
])
def test_each_endpoint_goes_to_a_worker_of_its_model(path: str, payload: dict[str, object], pool: str) -> None:
    svc, tracker = service()
    assert cluster(send(svc, "POST", path, payload)) == f"pool-{pool}"
    assert sum(tracker.counts.values()) == 0  # released at the stream's end


def test_the_catalogue_name_becomes_the_served_name_in_the_body() -> None:
    svc, _ = service()
    answer = send(svc, "POST", "/v1/embeddings", {"model": "embedder", "input": "a"})
    assert orjson.loads(answer.request_body.response.body_mutation.body)["model"] == "bge-m3"


def audio_form(model: str) -> bytes:
    return (b'--X\r\nContent-Disposition: form-data; name="file"; filename="a.mp3"\r\nContent-Type: audio/mpeg\r\n\r\n'
            + bytes(range(256)) * 10 + b'\r\n--X\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
            + model.encode() + b"\r\n--X--\r\n")


def test_audio_routes_by_its_form_field_and_the_catalogue_rewrites_it() -> None:
    svc, _ = service()
    answer = send(svc, "POST", "/v1/audio/transcriptions", audio_form("stt"), 'multipart/form-data; boundary="X"')
    assert cluster(answer) == "pool-speech"
    rewritten = answer.request_body.response.body_mutation.body
    assert rewritten.endswith(b'name="model"\r\n\r\nwhisper\r\n--X--\r\n')
    assert bytes(range(256)) * 10 in rewritten  # the audio is untouched


@pytest.mark.parametrize(("path", "payload", "model"), [
    ("/v1/embeddings", {"model": "llama", "input": "x"}, "llama"),
    ("/v1/chat/completions", {"model": "bge-m3", "messages": [{"role": "user", "content": "x"}]}, "bge-m3"),
    ("/v1/responses", {"model": "embedder", "input": "x"}, "bge-m3"),
    ("/rerank", {"model": "whisper", "query": "q", "documents": ["a"]}, "whisper"),
])
def test_an_endpoint_the_model_kind_does_not_serve_is_400(path: str, payload: dict[str, object], model: str) -> None:
    status, body_error = error(send(service()[0], "POST", path, payload))
    assert (status, body_error["code"], body_error["param"]) == (400, "unsupported_endpoint", "model")
    assert model in str(body_error["message"])


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/assistants"), ("GET", "/v1/embeddings"),
                                              ("DELETE", "/v1/responses"), ("GET", "/v1/models/llama")])
def test_unknown_v1_paths_and_methods_are_404_at_the_headers(method: str, path: str) -> None:
    status, body_error = error(send(service()[0], method, path))
    assert (status, body_error["type"], body_error["code"]) == (404, "invalid_request_error", "unknown_url")
    assert body_error["message"] == f"Invalid URL ({method} {path})"


def test_other_paths_still_pass_through() -> None:
    answer = send(service()[0], "GET", "/health")
    assert answer.WhichOneof("response") == "request_headers"
    assert not answer.request_headers.response.HasField("body_mutation")


def test_embeddings_reserve_no_decode_room() -> None:
    svc, _ = service()
    state = RequestState()
    svc.handle(state, headers("POST", "/v1/embeddings"))
    svc.handle(state, ProcessingRequest(request_body=HttpBody(body=orjson.dumps(
        {"model": "bge-m3", "input": ["x" * 400] * 3}), end_of_stream=True)))
    placement = state.context.placement
    assert placement is not None
    reservation = placement.reservation
    assert (reservation.kv_tokens, reservation.prefill_tokens, reservation.decode_tokens) == (300, 300, 0)
    svc.finish(state)


RESPONSES_STREAM_END = (
    b'event: response.output_text.done\ndata: {"type":"response.output_text.done","text":"hi there"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","usage":'
    b'{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":17}}}\n\n')


@pytest.mark.parametrize("split", [0, 40, 150, len(RESPONSES_STREAM_END) - 3])
def test_responses_api_usage_is_read_streamed_in_any_chunking(split: int) -> None:
    watch = UsageWatch(stream=True)
    for chunk, last in ((RESPONSES_STREAM_END[:split], False), (RESPONSES_STREAM_END[split:], True)):
        assert watch.feed(chunk, last) is None
    assert (watch.input_tokens, watch.output_tokens, watch.total_tokens) == (12, 5, 17)


@pytest.mark.parametrize(("payload", "tokens"), [
    ({"object": "response", "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}}, (3, 4, 7)),
    ({"object": "list", "usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0}}, (9, 0, 9)),
    ({"results": [], "usage": {"total_tokens": 11}}, (None, None, 11)),
    ({"text": "hi", "usage": {"type": "duration", "seconds": 4}}, (None, None, None)),
])
def test_usage_of_each_endpoint_body(payload: dict[str, object], tokens: tuple[int | None, ...]) -> None:
    watch = UsageWatch(stream=False)
    watch.feed(orjson.dumps(payload), True)
    assert (watch.input_tokens, watch.output_tokens, watch.total_tokens) == tokens


def test_responses_stream_time_to_first_token_is_its_first_delta() -> None:
    call = GenAiCall("/v1/responses", 0.0)
    call.stream = True
    opening = (b'event: response.created\ndata: {"type":"response.created","response":{"text":null,"output":[]}}\n\n'
               b'event: response.content_part.added\ndata: {"type":"response.content_part.added",'
               b'"part":{"type":"output_text","text":""}}\n\n')
    call.response_chunk(opening, False, 1.0)
    call.response_chunk(b'event: response.output_text.delta\ndata: {"delta":" hi"}\n\n', False, 2.0)
    assert (call.operation, call.first_output_at, call.ended) == ("chat", 2.0, False)
    call.response_chunk(RESPONSES_STREAM_END, False, 3.0)
    assert call.ended  # at response.completed, before the last byte
