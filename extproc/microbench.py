"""Per-request CPU of extproc's own work, without gRPC or Envoy: ``python -m extproc.microbench``.

Measures (1) parse + profile + pick over a fleet snapshot, (2) the servicer path per request: decode the two
ext_proc messages from bytes, answer both, encode the answers, release at stream end, and (3) the servicer
path per streamed response chunk while extproc watches the response (GenAI metrics and the usage watch):
decode the chunk's message, observe, encode the answer. gRPC's own cost per message comes on top (``bench
extproc_overhead`` measures the whole hop).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc.assembly import build_service
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.request import RequestFacts, RequestHead, facts_from_data, load_body
from extproc.scheduling import PickContext, RequestProfiler, default_scheduler
from extproc.service import RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord


@dataclass
class _Fleet:
    snapshot: FleetSnapshot


def _fleet(workers: int) -> FleetSnapshot:
    now = time.time()
    pools = (PoolSpec(name="chat", model="llama"),)
    records = [WorkerRecord(id=f"w{i}", pool="chat", model="llama", host="10.0.0.1", port=8000 + i,
                            updated_at=now) for i in range(workers)]
    return build_snapshot(records, pools, taken_at=now, stale_after_s=3.0)


def _body(prompt_chars: int) -> bytes:
    return orjson.dumps({"model": "llama", "max_tokens": 128, "stream": True,
                         "messages": [{"role": "system", "content": "You are helpful."},
                                      {"role": "user", "content": "x" * prompt_chars}]})


STREAM_CHUNK = (b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1700000000,'
                b'"model":"llama","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
                b'"finish_reason":null}]}\n\n')
"""One token's SSE event as vLLM sends it."""


def measure_chunks(n: int = 20_000) -> float:
    """Microseconds of servicer work per response chunk of a watched stream (GenAI metrics on)."""
    service = build_service(default_scheduler(random.Random(0)), _Fleet(_fleet(8)), InflightTracker(), Metrics(),
                            max_request_bytes=16 << 20, genai_metrics=True)
    header_values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in (
        (":method", "POST"), (":path", "/v1/chat/completions"), ("x-request-id", "r" * 36))]
    state = RequestState()
    service.handle(state, ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=header_values))))
    service.handle(state, ProcessingRequest(request_body=HttpBody(body=_body(200), end_of_stream=True)))
    status = HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
    service.handle(state, ProcessingRequest(response_headers=HttpHeaders(headers=status)))
    wire = ProcessingRequest(response_body=HttpBody(body=STREAM_CHUNK)).SerializeToString()
    started = time.process_time()
    for _ in range(n):
        service.handle(state, ProcessingRequest.FromString(wire)).SerializeToString()
    per_chunk = (time.process_time() - started) / n * 1e6
    service.finish(state)
    return per_chunk


def measure(n: int = 10_000, workers: int = 8, prompt_chars: int = 2_000) -> dict[str, float]:
    """Microseconds per request for parse+profile+pick and for the whole servicer path."""
    snapshot = _fleet(workers)
    scheduler = default_scheduler(random.Random(0))
    head = RequestHead("POST", "/v1/chat/completions", None)
    body = _body(prompt_chars)
    profiler = RequestProfiler(SchedulingSettings())
    context = PickContext(snapshot, {})
    started = time.process_time()
    for _ in range(n):
        data = load_body(body)
        assert isinstance(data, dict)
        facts = facts_from_data(head, data)
        assert isinstance(facts, RequestFacts)
        scheduler.pick(profiler.profile(facts), context)
    parse_pick_us = (time.process_time() - started) / n * 1e6

    tracker = InflightTracker()
    service = build_service(scheduler, _Fleet(snapshot), tracker, Metrics(), max_request_bytes=16 << 20)
    header_values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in (
        (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway"),
        ("content-type", "application/json"), ("content-length", str(len(body))), ("x-request-id", "r" * 36),
        ("user-agent", "OpenAI/Python 1.0"), ("authorization", "Bearer " + "k" * 40))]
    headers_message = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=header_values)))
    wire = [headers_message.SerializeToString(),
            ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)).SerializeToString()]
    started = time.process_time()
    for _ in range(n):
        state = RequestState()
        for raw in wire:
            service.handle(state, ProcessingRequest.FromString(raw)).SerializeToString()
        service.finish(state)
    servicer_us = (time.process_time() - started) / n * 1e6
    return {"parse_pick_us": parse_pick_us, "servicer_path_us": servicer_us}


if __name__ == "__main__":
    for workers in (8, 100):
        result = measure(workers=workers)
        print(f"{workers:>4} workers: parse+profile+pick {result['parse_pick_us']:.1f} µs/request, "
              f"servicer path {result['servicer_path_us']:.1f} µs/request")
    print(f"watched stream: servicer path {measure_chunks():.1f} µs per response chunk")
