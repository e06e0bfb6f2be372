"""With a pool tokenizer, the prompt's exact count (the engine's template and tokenizer) replaces the estimate
everywhere: the decision header, the context-length refusal and the quota charge.

Seen against a real vLLM: the decision header showed the characters-per-token estimate (1,250 against 1,623
real tokens), and a prompt over ``max_model_len`` went to the worker and came back as vLLM's own 400.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
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
from extproc.errors import ApiError
from extproc.inflight import InflightTracker
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.wiring import pool_tokenizers
from extproc.metrics import Metrics
from extproc.pipeline import DECISION_HEADER
from extproc.pipeline.outcomes import Refused
from extproc.scheduling import default_scheduler
from extproc.service import ExtProcService, Phase, RequestState
from extproc.snapshot import FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings, TaskClassRules
from poolgate.kernel.fleet import WorkerRecord
from tests.tiny_tokenizer import BOS, encode, make_tiny_tokenizer

NOW = 5000.0
MAX_MODEL_LEN = 1024


@dataclass
class Fleet:
    snapshot: FleetSnapshot


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}


def rendered(text: str) -> str:
    return f"{BOS}<|start_header_id|>user<|end_header_id|>\n\n{text.strip()}<|eot_id|>" \
           "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


def service(model_dir: Path, publishes: bool, **settings: Any) -> ExtProcService:
    pools = (PoolSpec(name="chat", model="tiny", max_model_len=MAX_MODEL_LEN,
                      tokenizer={"path": str(model_dir)}),)  # type: ignore[arg-type]
    worker = WorkerRecord(id="w1", pool="chat", model="tiny", host="127.0.0.1", port=9001, backend="vllm",
                          max_model_len=MAX_MODEL_LEN, updated_at=NOW, kv_block_size=128,
                          kv_events_endpoint="tcp://127.0.0.1:5557" if publishes else "")
    fleet = Fleet(build_snapshot([worker], pools, taken_at=NOW, stale_after_s=3))
    lookup = CacheLookup(PrefixIndex(), lambda: fleet.snapshot, pool_tokenizers(pools), clock=lambda: NOW)
    scheduling = SchedulingSettings(debug_header=True, **settings)
    return build_service(default_scheduler(random.Random(0), scheduling), fleet, InflightTracker(), Metrics(),
                         max_request_bytes=1 << 20, scheduling=scheduling, prefix_cache=lookup, clock=lambda: NOW)


def request_headers() -> ProcessingRequest:
    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gw")]
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=False))


async def answer(servicer: ExtProcService, data: dict[str, Any]) -> ProcessingResponse:
    state = RequestState()
    servicer.handle(state, request_headers())
    reply = servicer.handle(state, ProcessingRequest(request_body=HttpBody(body=orjson.dumps(data),
                                                                           end_of_stream=True)))
    if state.phase is Phase.ADMIT:
        reply = await servicer.admit(state)
    servicer.finish(state)
    return reply


def decision(reply: ProcessingResponse) -> str:
    sent = {h.header.key: h.header.raw_value.decode() for h in reply.request_body.response.header_mutation.set_headers}
    return sent[DECISION_HEADER]


TEXT = "zq xv jk " * 60  # words the tiny BPE never saw: far more tokens than characters / 4


@pytest.mark.parametrize("publishes", [True, False])
async def test_the_decision_header_shows_the_exact_prompt_tokens(model_dir: Path, publishes: bool) -> None:
    exact = len(encode(model_dir, rendered(TEXT)))
    estimate = len(TEXT) // 4 + 8
    assert exact > 1.5 * estimate  # the estimate would be far off
    reply = await answer(service(model_dir, publishes), chat(TEXT, max_tokens=50))
    assert f" prompt_tokens={exact} output_tokens=50 " in decision(reply)


async def test_a_prompt_over_max_model_len_gets_poolgates_own_400(model_dir: Path) -> None:
    text = "zq xv jk " * 120
    exact = len(encode(model_dir, rendered(text)))
    assert exact > MAX_MODEL_LEN and len(text) // 8 + 1 < MAX_MODEL_LEN  # the old floor let it through
    reply = await answer(service(model_dir, publishes=True), chat(text))
    assert reply.immediate_response.status.code == 400
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert f"needs at least {exact + 1} tokens" in error["message"] and f"at most {MAX_MODEL_LEN}" in error["message"]


async def test_max_tokens_past_the_context_is_refused_with_the_exact_prompt(model_dir: Path) -> None:
    exact = len(encode(model_dir, rendered(TEXT)))
    fits = await answer(service(model_dir, publishes=True), chat(TEXT, max_tokens=MAX_MODEL_LEN - exact))
    assert fits.request_body.response.clear_route_cache
    over = await answer(service(model_dir, publishes=True), chat(TEXT, max_tokens=MAX_MODEL_LEN - exact + 1))
    assert over.immediate_response.status.code == 400


async def test_quotas_are_charged_the_exact_prompt(model_dir: Path) -> None:
    servicer = service(model_dir, publishes=False)
    admit_stage = servicer.director.admit_stage
    charged: list[int] = []

    async def admit(tenant: object, tokens: int) -> Refused:
        charged.append(tokens)
        return Refused(ApiError(429, "tokens per minute", "rate_limit_error", "tokens_per_minute"))

    admit_stage.applies = lambda tenant: True  # type: ignore[method-assign]
    admit_stage.admit = admit  # type: ignore[method-assign]
    reply = await answer(servicer, chat(TEXT, max_tokens=50))
    assert reply.immediate_response.status.code == 429
    assert charged == [len(encode(model_dir, rendered(TEXT))) + 50]


async def test_an_exact_long_prompt_is_classed_long_context(model_dir: Path) -> None:
    rules = TaskClassRules(long_context_min_tokens=300)
    reply = await answer(service(model_dir, publishes=True, task_classes=rules), chat(TEXT, max_tokens=50))
    assert " class=long_context " in decision(reply)
