"""The OpenTelemetry GenAI histograms, driven through the servicer with ext_proc messages and a stepped timer:
what a streamed and a non-streamed request record, what errors record, and what the switch turns off."""

from __future__ import annotations

import random
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

from extproc.catalogue import Catalogue
from extproc.catalogue_source import CatalogueSource
from extproc.genai import OPERATIONS, GenAiCall
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.scheduling import default_scheduler
from extproc.service import RequestState
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.metrics_doc import GENAI_ATTRIBUTES, GENAI_SERIES, exported_metrics
from tests.unit.test_extproc_service import NOW, POOLS, Fleet, Rig, body, headers, ready, rig

CHAT_LABELS = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
               "gen_ai_request_model": "llama", "gen_ai_response_model": "llama"}
USAGE = b'"usage":{"prompt_tokens":9,"completion_tokens":5,"total_tokens":14}'


class SteppedTimer:
    """The servicer's monotonic timer, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_service(genai: bool = True, workers: tuple[WorkerRecord, ...] = (),
                 catalogue: Catalogue | None = None,
                 pools: tuple[PoolSpec, ...] = POOLS) -> tuple[Rig, Metrics, SteppedTimer]:
    timer, metrics = SteppedTimer(), Metrics()
    fleet = Fleet(build_snapshot(workers or (ready("w1", 9001),), pools, taken_at=NOW, stale_after_s=3))
    service = rig(default_scheduler(random.Random(0)), fleet, InflightTracker(), metrics, max_request_bytes=1 << 20,
                  timer=timer, rng=random.Random(0),
                  catalogue=CatalogueSource(catalogue) if catalogue is not None else None,
                  genai_metrics=genai)
    return service, metrics, timer


def response_headers(status: int, end: bool = False) -> ProcessingRequest:
    values = [HeaderValue(key=":status", raw_value=str(status).encode()),
              HeaderValue(key="content-type", raw_value=b"text/event-stream")]
    return ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end))


def chunk(data: bytes, end: bool = False) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=end))


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def delta(text: str, usage_null: bool = False) -> bytes:
    tail = b',"usage":null' if usage_null else b""
    return event(b'{"choices":[{"index":0,"delta":{"content":' + orjson.dumps(text) + b"}}]" + tail + b"}")


ROLE_ONLY = event(b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
USAGE_CHUNK = event(b'{"choices":[],' + USAGE + b"}")
DONE = b"data: [DONE]\n\n"


def sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def step(service: Rig, state: RequestState, timer: SteppedTimer, at: float,
         message: ProcessingRequest) -> ProcessingResponse:
    timer.now = 100.0 + at
    return service.handle(state, message)


def test_streamed_chat_records_usage_ttft_tpot_and_duration_and_hides_the_usage_chunk() -> None:
    service, metrics, timer = make_service()
    state = RequestState()
    opened = step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    mode = opened.mode_override
    assert (mode.response_header_mode, mode.response_body_mode) == (mode.SEND, mode.STREAMED)
    routed = step(service, state, timer, 0.01, body({"model": "llama", "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
    sent = orjson.loads(routed.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}  # asked on the client's behalf
    step(service, state, timer, 0.2, response_headers(200))
    answers = [step(service, state, timer, 0.3, chunk(ROLE_ONLY)),  # before any token: not the first one
               step(service, state, timer, 0.5, chunk(delta("Hel"))),
               step(service, state, timer, 0.6, chunk(delta("lo") + delta(" the"))),
               step(service, state, timer, 0.7, chunk(delta("re"))),
               step(service, state, timer, 0.9, chunk(USAGE_CHUNK + DONE, end=True))]
    assert [a.response_body.HasField("response") for a in answers[:-1]] == [False] * 4  # passed on unchanged
    assert answers[-1].response_body.response.body_mutation.body == DONE  # the client did not ask for usage
    duration = {**CHAT_LABELS, "error_type": ""}
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count", duration) == 1  # at the last byte
    timer.now = 105.0  # the stream closes later, which changes nothing
    service.finish(state)
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count", duration) == 1

    for token_type, tokens in (("input", 9), ("output", 5)):
        labels = {**CHAT_LABELS, "gen_ai_token_type": token_type}
        assert sample(metrics, "gen_ai_client_token_usage_count", labels) == 1
        assert sample(metrics, "gen_ai_client_token_usage_sum", labels) == tokens
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_sum", CHAT_LABELS) == pytest.approx(0.5)
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_bucket", {**CHAT_LABELS, "le": "0.5"}) == 1
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_bucket", {**CHAT_LABELS, "le": "0.25"}) == 0
    # (0.9 - 0.5) / (5 - 1)
    assert sample(metrics, "gen_ai_server_time_per_output_token_seconds_sum", CHAT_LABELS) == pytest.approx(0.1)
    assert sample(metrics, "gen_ai_server_request_duration_seconds_sum", duration) == pytest.approx(0.9)
    assert sample(metrics, "gen_ai_server_request_duration_seconds_bucket", {**duration, "le": "1.28"}) == 1
    assert sample(metrics, "gen_ai_server_request_duration_seconds_bucket", {**duration, "le": "0.64"}) == 0


def test_non_streamed_completion_records_duration_and_usage_but_no_token_timing() -> None:
    service, metrics, timer = make_service()
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/completions"))
    routed = step(service, state, timer, 0.0, body({"model": "llama", "prompt": "hi", "max_tokens": 5}))
    assert not routed.request_body.response.HasField("body_mutation")  # nothing to ask of a JSON answer
    answer = b'{"choices":[{"index":0,"text":"hello there"}],' + USAGE + b"}"
    step(service, state, timer, 1.0, response_headers(200))
    step(service, state, timer, 1.5, chunk(answer[:20]))  # a JSON answer may come in several chunks
    step(service, state, timer, 2.0, chunk(answer[20:], end=True))
    service.finish(state)

    labels = {**CHAT_LABELS, "gen_ai_operation_name": "text_completion"}
    assert sample(metrics, "gen_ai_client_token_usage_sum", {**labels, "gen_ai_token_type": "input"}) == 9
    assert sample(metrics, "gen_ai_client_token_usage_sum", {**labels, "gen_ai_token_type": "output"}) == 5
    assert sample(metrics, "gen_ai_server_request_duration_seconds_sum",
                  {**labels, "error_type": ""}) == pytest.approx(2.0)
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_count", labels) is None
    assert sample(metrics, "gen_ai_server_time_per_output_token_seconds_count", labels) is None


def test_a_client_that_asked_for_usage_gets_its_chunk_and_chunks_are_parsed_only_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []

    class CountingJson:
        JSONDecodeError = orjson.JSONDecodeError

        @staticmethod
        def loads(data: Any) -> Any:
            parsed.append(bytes(data))
            return orjson.loads(data)

    monkeypatch.setattr("extproc.usage.orjson", CountingJson)
    service, metrics, timer = make_service()
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    routed = step(service, state, timer, 0.0, body({"model": "llama", "stream": True,
                                                     "stream_options": {"include_usage": True},
                                                     "messages": [{"role": "user", "content": "hi"}]}))
    assert not routed.request_body.response.HasField("body_mutation")  # already asked: the body is untouched
    step(service, state, timer, 0.1, response_headers(200))
    for index in range(20):  # OpenAI-style streams say "usage":null in every chunk
        step(service, state, timer, 0.2 + index / 100, chunk(delta(f"t{index}", usage_null=True)))
    last = step(service, state, timer, 0.5, chunk(USAGE_CHUNK + DONE, end=True))
    assert not last.response_body.HasField("response")  # the client's own usage chunk reaches it
    service.finish(state)
    assert len(parsed) == 1 and b'"prompt_tokens":9' in parsed[0]
    output = {**CHAT_LABELS, "gen_ai_token_type": "output"}
    assert sample(metrics, "gen_ai_client_token_usage_sum", output) == 5
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_sum", CHAT_LABELS) == pytest.approx(0.2)


@pytest.mark.parametrize(("messages", "error_type", "model"), [
    # a worker's error status: its duration, no usage, no token timing
    ((response_headers(503), chunk(b'{"error":{"message":"busy"}}', end=True)), "503", "llama"),
    # the client went away mid-stream (or the worker's connection broke): never reached its last byte
    ((response_headers(200), chunk(delta("Hel"))), "incomplete", "llama"),
    # generation failed after the 200: vLLM's error event, then [DONE]; no token timing from a broken stream
    ((response_headers(200), chunk(ROLE_ONLY + delta("Hel")), chunk(delta("lo")),
      chunk(event(b'{"error":{"object":"error","message":"engine died","type":"InternalServerError","param":null,'
                  b'"code":500}}') + DONE, end=True)), "stream_error", "llama"),
])
def test_failed_responses_record_their_error_type(messages: tuple[ProcessingRequest, ...], error_type: str,
                                                  model: str) -> None:
    service, metrics, timer = make_service()
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    step(service, state, timer, 0.0, body({"model": "llama", "stream": True,
                                           "messages": [{"role": "user", "content": "hi"}]}))
    for at, message in enumerate(messages, start=1):
        step(service, state, timer, at / 10, message)
    timer.now = 103.0
    service.finish(state)
    failed = {**CHAT_LABELS, "error_type": error_type}
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count", failed) == 1
    expected = len(messages) / 10 if error_type != "incomplete" else 3.0  # last byte, or the stream's close
    assert sample(metrics, "gen_ai_server_request_duration_seconds_sum", failed) == pytest.approx(expected)
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count", {**CHAT_LABELS, "error_type": ""}) is None
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_count", CHAT_LABELS) is None
    assert sample(metrics, "gen_ai_client_token_usage_count", {**CHAT_LABELS, "gen_ai_token_type": "input"}) is None


@pytest.mark.parametrize(("model", "error_type", "request_model"), [
    ("llama", "no_ready_worker", "llama"),  # a known model: the label names it
    ("made-up-4242", "model_not_found", ""),  # a client's invented name never becomes a series
])
def test_extproc_error_answers_record_their_code(model: str, error_type: str, request_model: str) -> None:
    service, metrics, timer = make_service(workers=(ready("c1", 9002, "code"),))
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    answer = step(service, state, timer, 0.25, body({"model": model, "messages": [{"role": "user", "content": "x"}]}))
    assert answer.immediate_response.status.code in {404, 503}
    timer.now = 109.0
    service.finish(state)
    labels = {**CHAT_LABELS, "gen_ai_request_model": request_model, "gen_ai_response_model": "",
              "error_type": error_type}
    assert sample(metrics, "gen_ai_server_request_duration_seconds_sum", labels) == pytest.approx(0.25)


def test_catalogue_requests_name_the_public_model_asked_and_the_served_version_that_answered() -> None:
    config = parse_config({
        "pools": [{"name": "chat-b", "model": "chat-v2"}],
        "catalogue": {"models": [{"name": "chat", "versions": [{"name": "v2", "served_name": "chat-v2"}]}]},
    })
    worker = WorkerRecord(id="b1", pool="chat-b", model="chat-v2", host="127.0.0.1", port=9005, updated_at=NOW)
    service, metrics, timer = make_service(workers=(worker,), catalogue=Catalogue(config.catalogue),
                                           pools=config.pools)
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    step(service, state, timer, 0.0, body({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
    step(service, state, timer, 0.1, response_headers(200))
    restored = step(service, state, timer, 0.2, chunk(b'{"model":"chat-v2",' + USAGE + b"}", end=True))
    assert restored.response_body.response.body_mutation.body.startswith(b'{"model":"chat",')
    service.finish(state)
    labels = {**CHAT_LABELS, "gen_ai_request_model": "chat", "gen_ai_response_model": "chat-v2",
              "gen_ai_token_type": "output"}
    assert sample(metrics, "gen_ai_client_token_usage_sum", labels) == 5


def test_switched_off_nothing_is_watched_or_recorded() -> None:
    service, metrics, timer = make_service(genai=False)
    state = RequestState()
    opened = step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    assert not opened.HasField("mode_override")  # the response never comes to extproc
    routed = step(service, state, timer, 0.0, body({"model": "llama", "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]}))
    assert not routed.request_body.response.HasField("body_mutation")  # no include_usage injected
    service.finish(state)
    assert not [s for f in metrics.registry.collect() if f.name.startswith("gen_ai_") for s in f.samples]


def test_the_documented_names_are_the_exported_translations_of_the_conventions() -> None:
    """Dots become underscores, the unit ``s`` adds ``_seconds``, ``{token}`` adds nothing."""
    exported = {f.name: f for f in exported_metrics() if f.process == "extproc"}
    for otel, prometheus, _ in GENAI_SERIES:
        unit = "" if otel == "gen_ai.client.token.usage" else "_seconds"
        assert prometheus == otel.replace(".", "_") + unit
        assert exported[prometheus].type == "histogram"
    labels = set().union(*(exported[p].labels for _, p, _ in GENAI_SERIES))
    assert labels == {name.replace(".", "_") for name, _ in GENAI_ATTRIBUTES}
    assert set(OPERATIONS.values()) - {""} == {"chat", "text_completion", "embeddings"}


def test_generated_text_that_looks_like_an_error_event_is_output_not_an_error() -> None:
    call = GenAiCall("/v1/chat/completions", started=0.0)
    call.stream = True
    call.response_headers(200, end_of_stream=False, now=0.1)
    call.response_chunk(delta('data: {"error": "not really"}'), end_of_stream=False, now=0.2)
    call.response_chunk(DONE, end_of_stream=True, now=0.3)
    assert call.outcome() == "" and call.first_output_at == 0.2


def test_a_client_that_closes_on_done_got_a_whole_answer() -> None:
    """The openai SDK stops reading at ``[DONE]`` and closes: Envoy then ends extproc's stream before the
    response's last byte. That request succeeded, and is recorded at its ``[DONE]``."""
    service, metrics, timer = make_service()
    state = RequestState()
    step(service, state, timer, 0.0, headers("POST", "/v1/chat/completions"))
    step(service, state, timer, 0.0, body({"model": "llama", "stream": True,
                                           "messages": [{"role": "user", "content": "hi"}]}))
    step(service, state, timer, 0.1, response_headers(200))
    step(service, state, timer, 0.2, chunk(ROLE_ONLY + delta("Hel")))
    step(service, state, timer, 0.3, chunk(delta("lo") + USAGE_CHUNK + DONE))
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count", {**CHAT_LABELS, "error_type": ""}) == 1
    timer.now = 105.0
    service.finish(state)  # the stream closes without the last byte: nothing more is recorded
    assert sample(metrics, "gen_ai_server_request_duration_seconds_sum",
                  {**CHAT_LABELS, "error_type": ""}) == pytest.approx(0.3)
    assert sample(metrics, "gen_ai_server_request_duration_seconds_count",
                  {**CHAT_LABELS, "error_type": "incomplete"}) is None
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_sum", CHAT_LABELS) == pytest.approx(0.2)
    assert sample(metrics, "gen_ai_client_token_usage_sum", {**CHAT_LABELS, "gen_ai_token_type": "output"}) == 5
