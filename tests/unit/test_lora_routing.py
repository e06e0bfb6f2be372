"""LoRA requests on the request path: name resolution, the body rewrite, the scorer and the room filter."""

from __future__ import annotations

import random

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc.assembly import build_service
from extproc.catalogue import Catalogue
from extproc.catalogue_source import CatalogueSource
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.request import RequestFacts
from extproc.scheduling import Decision, PickContext, PickRequest, default_scheduler
from extproc.scheduling.lora_filter import AdapterRoom
from extproc.scheduling.scorers.lora_affinity import LoraAffinity
from extproc.service import RequestState
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import ConfigError, parse_config
from poolgate.kernel.fleet import WorkerRecord

NOW = 5000.0
CONFIG = parse_config({
    "pools": [{"name": "base", "model": "llama"}, {"name": "other", "model": "qwen:7b"}],
    "catalogue": {
        "models": [{"name": "chat", "versions": [{"name": "v1", "served_name": "llama"}]}],
        "adapters": [{"name": "sql", "base": "llama", "path": "/adapters/sql"}],
    },
})
RNG = random.Random(0)


def worker(worker_id: str, adapters: tuple[str, ...] = (), max_loras: int = 0, port: int = 9000) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="base", model="llama", host="127.0.0.1", port=port, updated_at=NOW,
                        lora_adapters=adapters, max_loras=max_loras)


def pick_request(adapter: str | None) -> PickRequest:
    return PickRequest(RequestFacts("/v1/completions", "POST", "llama"), 10, 10, 10, "short_chat",
                       adapter=adapter)


def context(workers: list[WorkerRecord]) -> PickContext:
    return PickContext(build_snapshot(workers, CONFIG.pools, NOW, 3.0), {})


@pytest.mark.parametrize(("asked", "served", "adapter", "public"), [
    ("sql", "llama", "sql", "sql"),
    ("llama:chat-lora", "llama", "chat-lora", "llama:chat-lora"),
    ("chat:sql", "llama", "sql", "chat:sql"),
    ("chat", "llama", None, "chat"),
])
def test_adapter_names_resolve_to_the_base(asked: str, served: str, adapter: str | None, public: str) -> None:
    route = Catalogue(CONFIG.catalogue).resolve(asked, "t", RNG)
    assert route is not None
    assert (route.served_name, route.adapter, route.public_name) == (served, adapter, public)
    assert route.body_model == (adapter or served) and route.touches_body


@pytest.mark.parametrize("asked", ["qwen:7b", "unknown:sql", ":sql", "llama:"])
def test_colon_names_of_unknown_bases_are_left_alone(asked: str) -> None:
    assert Catalogue(CONFIG.catalogue).resolve(asked, "t", RNG) is None


def test_adapter_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"pools": [{"name": "p", "model": "m"}], "catalogue": {"adapters": [
            {"name": "a", "base": "m"}, {"name": "a", "base": "m"}]}})
    with pytest.raises(ConfigError, match="name"):
        parse_config({"pools": [{"name": "p", "model": "m"}], "catalogue": {"adapters": [
            {"name": "m:a", "base": "m"}]}})


def test_scorer_formula() -> None:
    workers = [worker("has", ("sql",), 2), worker("free", ("x",), 2), worker("full", ("x", "y"), 2),
               worker("no-lora")]
    assert list(LoraAffinity().score(pick_request("sql"), workers, context(workers))) == [1.0, 0.5, 0.0, 0.0]
    assert list(LoraAffinity().score(pick_request(None), workers, context(workers))) == [0.0] * 4


def test_room_filter_keeps_all_when_nobody_has_room() -> None:
    room = AdapterRoom()
    full = [worker("full", ("x",), 1), worker("no-lora")]
    assert list(room.filter(pick_request("sql"), full, context(full))) == full
    mixed = [*full, worker("free", (), 1)]
    assert [w.id for w in room.filter(pick_request("sql"), mixed, context(mixed))] == ["free"]
    assert list(room.filter(pick_request(None), mixed, context(mixed))) == mixed


@pytest.mark.parametrize("seed", range(5))
def test_pick_prefers_the_worker_running_the_adapter(seed: int) -> None:
    workers = [worker("free", (), 2, port=9001), worker("has", ("sql",), 2, port=9002),
               worker("full", ("a", "b"), 2, port=9003)]
    outcome = default_scheduler(random.Random(seed)).pick(pick_request("sql"), context(workers))
    assert isinstance(outcome, Decision) and outcome.worker_id == "has"


class Fleet:
    def __init__(self, workers: list[WorkerRecord]) -> None:
        self.snapshot = build_snapshot(workers, CONFIG.pools, taken_at=NOW, stale_after_s=3)


def test_service_sends_the_adapter_name_to_a_worker_of_the_base() -> None:
    fleet = Fleet([worker("free", (), 1, port=9001), worker("has", ("sql",), 1, port=9002)])
    svc = build_service(default_scheduler(random.Random(0)), fleet, InflightTracker(), Metrics(),
                        max_request_bytes=1 << 20, clock=lambda: NOW,
                        catalogue=CatalogueSource(Catalogue(CONFIG.catalogue)), rng=random.Random(0))
    state = RequestState()
    pairs = [(":method", "POST"), (":path", "/v1/completions")]
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    svc.handle(state, ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values))))
    routed = svc.handle(state, ProcessingRequest(request_body=HttpBody(
        body=orjson.dumps({"model": "llama:sql", "prompt": "select", "max_tokens": 8}), end_of_stream=True)))
    sent = orjson.loads(routed.request_body.response.body_mutation.body)
    assert sent["model"] == "sql" and sent["max_tokens"] == 8
    assert state.decision is not None and state.decision.worker_id == "has"
    assert state.request is not None and (state.request.model, state.request.adapter) == ("llama", "sql")
    svc.finish(state)
