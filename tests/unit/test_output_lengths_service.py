"""The servicer learns output lengths from the usage in the responses it reads, and the next requests are
planned with them (seen in the decision header) instead of the default."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc.pipeline import DECISION_HEADER
from extproc.service import RequestState
from poolgate.kernel.config import LearnedOutputSettings, SchedulingSettings
from tests.unit.test_extproc_service import CHAT, body, headers, kv_worker, make_service


def decision_output_tokens(answer: object) -> int:
    sent = {h.header.key: h.header.raw_value.decode()
            for h in answer.request_body.response.header_mutation.set_headers}  # type: ignore[attr-defined]
    fields = dict(part.split("=", 1) for part in sent[DECISION_HEADER].split())
    return int(fields["output_tokens"])


def test_lengths_read_in_usage_become_the_expected_output() -> None:
    settings = SchedulingSettings(debug_header=True, learned_output=LearnedOutputSettings(
        min_samples=3, sample_every=1, quantile=1.0))
    service, _, _ = make_service(kv_worker("w1", 9001, 0.1), settings=settings)
    planned = []
    for completion_tokens in (30, 40, 35, 20):
        state = RequestState()
        service.handle(state, headers("POST", "/v1/chat/completions"))
        planned.append(decision_output_tokens(service.handle(state, body(CHAT))))
        service.handle(state, ProcessingRequest(response_headers=HttpHeaders()))
        answer = {"object": "chat.completion", "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                                                         "total_tokens": 9 + completion_tokens}}
        service.handle(state, ProcessingRequest(response_body=HttpBody(body=orjson.dumps(answer), end_of_stream=True)))
        service.finish(state)
    assert planned == [256, 256, 256, 40]  # the default until three lengths are known, then their maximum
