"""The servicer with tenants, driven without gRPC: 401 / 403, forged headers, dedicated pools, the queue."""

from __future__ import annotations

import asyncio
import random

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.pipeline import TENANT_HEADER
from extproc.scheduling import default_scheduler
from extproc.service import Phase, RequestState
from extproc.snapshot import build_snapshot
from extproc.tenancy import TenantDirectory, key_digest
from poolgate.kernel.config import PoolSpec, SchedulingSettings, parse_config
from poolgate.kernel.fleet import WorkerRecord
from tests.unit.test_extproc_service import CHAT, LIMIT, NOW, Fleet, Rig, body, headers, kv_worker, pin_of, ready, rig

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="vip", model="llama"),
         PoolSpec(name="code", model="coder"))


TENANTS = [
    {"name": "gold", "api_key_sha256": [key_digest("gold-key")], "priority": "high",
     "dedicated_pools": ["vip"], "dedicated_only": False},
    {"name": "bronze", "api_key_sha256": [key_digest("bronze-key")], "priority": "low", "models": ["llama"]},
]


def service_with(*workers: WorkerRecord, max_wait_s: float = 5, tenants: list[dict[str, object]] | None = None,
                 **tenancy: object) -> tuple[Rig, Metrics]:
    cfg = parse_config({"pools": [p.model_dump() for p in POOLS], "tenancy": tenancy,
                        "tenants": TENANTS if tenants is None else tenants})
    settings = SchedulingSettings(max_wait_s=max_wait_s)
    metrics = Metrics()
    service = rig(default_scheduler(random.Random(0), settings),
                  Fleet(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3)), InflightTracker(), metrics,
                  max_request_bytes=LIMIT, scheduling=settings, tenants=TenantDirectory(cfg.tenancy, cfg.tenants))
    return service, metrics


def vip(worker_id: str, port: int) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="vip", model="llama", host="127.0.0.1", port=port, updated_at=NOW)


def ask(service: Rig, key: str | None, data: object = CHAT,
        extra: dict[str, str] | None = None) -> tuple[RequestState, list[object]]:
    state = RequestState()
    auth = {"authorization": f"Bearer {key}"} if key else {}
    first = service.handle(state, headers("POST", "/v1/chat/completions", extra={**auth, **(extra or {})}))
    if state.phase is Phase.DONE:
        return state, [first]
    return state, [first, service.handle(state, body(data))]


def error(answer: object) -> tuple[int, str]:
    reply = answer.immediate_response  # type: ignore[attr-defined]
    return reply.status.code, orjson.loads(reply.body)["error"]["code"]


def test_missing_or_wrong_key_is_401_at_the_headers_phase() -> None:
    service, metrics = service_with(ready("w1", 9001), require_api_key=True)
    for key in (None, "nope"):
        _, answers = ask(service, key)
        assert len(answers) == 1 and error(answers[0]) == (401, "invalid_api_key")
    assert metrics.registry.get_sample_value("poolgate_extproc_rejections_total",
                                             {"tenant": "unknown", "reason": "invalid_api_key"}) == 2
    _, answers = ask(service, "gold-key")
    sent = {h.header.key: h.header.raw_value for h in
            answers[-1].request_body.response.header_mutation.set_headers}  # type: ignore[attr-defined]
    assert sent[TENANT_HEADER] == b"gold"


def test_model_not_allowed_is_403() -> None:
    service, _ = service_with(ready("w1", 9001), ready("c1", 9002, "code"), require_api_key=True)
    _, answers = ask(service, "bronze-key", {**CHAT, "model": "coder"})
    assert error(answers[-1]) == (403, "model_not_allowed")


def test_forged_tenant_header_is_stripped_and_ignored() -> None:
    service, _ = service_with(ready("w1", 9001), require_api_key=True, tenant_header="x-tenant-id")
    _, answers = ask(service, None, extra={"x-tenant-id": "gold"})
    assert error(answers[-1]) == (401, "invalid_api_key")
    _, answers = ask(service, "bronze-key", extra={"x-tenant-id": "gold"})
    mutation = answers[-1].request_body.response.header_mutation  # type: ignore[attr-defined]
    assert "x-tenant-id" in mutation.remove_headers
    assert {h.header.key: h.header.raw_value for h in mutation.set_headers}[TENANT_HEADER] == b"bronze"


def test_no_other_tenant_lands_on_a_dedicated_pool() -> None:
    service, _ = service_with(ready("w1", 9001), vip("v1", 9100))
    pins = {pin_of(ask(service, "bronze-key")[1][-1]) for _ in range(10)}  # type: ignore[arg-type]
    pins |= {pin_of(ask(service, None)[1][-1]) for _ in range(10)}  # type: ignore[arg-type]
    assert pins == {"127.0.0.1:9001"}
    gold = {pin_of(ask(service, "gold-key")[1][-1]) for _ in range(10)}  # type: ignore[arg-type]
    assert "127.0.0.1:9100" in gold


def test_only_dedicated_pools_when_restricted() -> None:
    service, _ = service_with(ready("w1", 9001), tenants=[
        {"name": "gold", "api_key_sha256": [key_digest("gold-key")], "dedicated_pools": ["vip"]}])
    _, answers = ask(service, "gold-key")
    assert error(answers[-1]) == (403, "model_not_allowed")  # its only pool has no worker for the model


LONG = {"model": "llama", "max_tokens": 100, "messages": [{"role": "user", "content": "word " * 2000}]}


async def test_queue_releases_the_higher_class_first_and_drops_cancelled() -> None:
    service, metrics = service_with(kv_worker("w1", 9001, 0.5))
    first, answers = ask(service, None, LONG)
    assert answers[-1].request_body.response.clear_route_cache  # type: ignore[attr-defined]
    low, low_answers = ask(service, "bronze-key", LONG)
    gone, _ = ask(service, "bronze-key", LONG)
    high, _ = ask(service, "gold-key", LONG)
    assert low_answers[-1].HasField("override_message_timeout")  # type: ignore[attr-defined]
    assert high.phase is Phase.HELD and low.phase is Phase.HELD and len(service.queue) == 3
    assert metrics.registry.get_sample_value("poolgate_extproc_queue_depth",
                                             {"priority_class": "low", "tenant": "bronze"}) == 2
    holds = [asyncio.create_task(service.hold(s)) for s in (low, gone, high)]
    await asyncio.sleep(0.05)
    holds[1].cancel()
    await asyncio.gather(holds[1], return_exceptions=True)
    service.finish(gone)  # what the stream's end does
    assert len(service.queue) == 2
    service.finish(first)  # capacity for one
    done, _ = await asyncio.wait((holds[0], holds[2]), timeout=1, return_when=asyncio.FIRST_COMPLETED)
    assert holds[2] in done and not holds[0].done()
    service.finish(high)
    answer = await asyncio.wait_for(holds[0], 1)
    assert answer.request_body.response.clear_route_cache
    assert metrics.registry.get_sample_value("poolgate_extproc_queue_wait_seconds_count",
                                             {"priority_class": "low", "outcome": "cancelled"}) == 1


def test_response_body_messages_pass_through_without_a_watch() -> None:
    service, _ = service_with(ready("w1", 9001))
    state, _ = ask(service, None)
    chunk = ProcessingRequest(response_body=HttpBody(body=b"data: x\n\n", end_of_stream=False))
    answer = service.handle(state, chunk)
    assert answer.WhichOneof("response") == "response_body" and not answer.response_body.HasField("response")
