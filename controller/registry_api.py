"""The controller's HTTP API: workers register, heartbeat and deregister; operators list the fleet.

Every call except ``/healthz`` needs ``Authorization: Bearer <token>`` (the shared controller token), so a
stranger on the network cannot add an address to Envoy's endpoints. Errors are OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import ipaddress
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Required

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from controller.backend import PlacementRefused
from controller.batched_writes import HeartbeatCoalescer, RegistrationCoalescer
from controller.fleet_count import FleetCount
from controller.heartbeat_interval import HeartbeatPace, NextBeat, next_beat
from controller.instances import InstanceController, NotLeader
from controller.overload import LoopLag
from poolgate.kernel.config import ControllerSettings, PoolScaling, PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.store import FleetStore
from poolgate.kernel.store_scripts import REGISTRY_ALIVE_S

log = logging.getLogger("poolgate.controller.api")


class Registration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    pool: str
    host: str
    port: int = Field(gt=0, le=65535)
    model: str | None = None
    served_names: tuple[str, ...] = ()
    max_model_len: int | None = Field(None, gt=0)
    backend: str = "external"
    state: WorkerState = WorkerState.READY
    node: str | None = Field(None, pattern=r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?$")
    """The node (machine) the worker runs on, as that node's agent names it (``poolgate agent --node``;
    on Kubernetes the pod's ``spec.nodeName``). Without it the agents match the worker by its address."""
    kv_events_endpoint: str = Field("", pattern=r"^(tcp://[^\s]+:\d{1,5}|ipc://\S+)?$")
    """Where the engine publishes KV-cache events (``--kv-events-config``), as a subscriber connects to it."""
    kv_events_replay_endpoint: str = Field("", pattern=r"^(tcp://[^\s]+:\d{1,5}|ipc://\S+)?$")


MAX_BATCH = 1000
"""Workers one batch heartbeat may carry (a node has a few to a few hundred)."""


@with_config(ConfigDict(extra="forbid"))
class Heartbeat(TypedDict, total=False):
    """The live facts a worker may report (a subset of ``LIVE_FIELDS``; extra fields are refused; null is as
    if left out). Typed dicts, not models: at 10,000 workers the API checks 2,500 node batches a second, and
    building a model per worker made that check two to four times as dear."""

    state: WorkerState | None
    kv_capacity_tokens: Annotated[int, Field(ge=0)] | None
    kv_block_size: Annotated[int, Field(gt=0)] | None
    kv_usage: Annotated[float, Field(ge=0, le=1)] | None
    running: Annotated[int, Field(ge=0)] | None
    waiting: Annotated[int, Field(ge=0)] | None
    preemptions_total: Annotated[int, Field(ge=0)] | None
    ttft_ewma_s: float | None
    prefill_tokens_per_s: Annotated[float, Field(ge=0)] | None
    gpu_memory_total_mib: float | None
    gpu_memory_free_mib: float | None
    gpu_utilization: float | None


class NodeHeartbeat(Heartbeat):
    """One worker's part of a batch heartbeat: its id and the facts it reports."""

    id: Required[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]]


@with_config(ConfigDict(extra="forbid"))
class HeartbeatBatch(TypedDict):
    """A node agent's heartbeat for all the workers of its node at once."""

    workers: Annotated[list[NodeHeartbeat], Field(max_length=MAX_BATCH)]


HEARTBEAT = TypeAdapter(Heartbeat)
HEARTBEAT_BATCH = TypeAdapter(HeartbeatBatch)


def _reported(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The facts a heartbeat reports (not the worker's id); those it left null are not reported."""
    return {name: value for name, value in facts.items() if value is not None and name != "id"}


@dataclass(frozen=True)
class Answer:
    """A JSON answer to a worker's call, whichever server sends it (aiohttp here, the API processes' lean
    front: ``controller.lean_front``)."""

    status: int
    body: bytes
    retry_after: int | None = None


def error_answer(status: int, message: str, code: str) -> Answer:
    """An OpenAI-style error answer."""
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": code}}
    return Answer(status, orjson.dumps(body))


def error_response(status: int, message: str, code: str) -> web.Response:
    return response(error_answer(status, message, code))


def response(answer: Answer) -> web.Response:
    headers = {"Retry-After": str(answer.retry_after)} if answer.retry_after is not None else None
    return web.Response(status=answer.status, body=answer.body, content_type="application/json", headers=headers)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _pace_fields(beat: NextBeat) -> dict[str, float]:
    """What every registration and heartbeat answer tells the worker: beat again within ``heartbeat_interval_s``
    (its own, jittered); the registry forgets it ``heartbeat_ttl_s`` after this call without another."""
    return {"heartbeat_interval_s": round(beat.interval_s, 3), "heartbeat_ttl_s": round(beat.ttl_s, 3)}


HEALTHY = Answer(200, orjson.dumps({"status": "ok"}))
"""``GET /healthz``: the registry answers."""
UNAUTHORIZED = error_answer(401, "missing or wrong controller token (Authorization: Bearer <token>)", "unauthorized")


OPEN_PATHS = frozenset({"/healthz", "/metrics"})
"""Paths without the token: liveness and Prometheus counters (they reveal no addresses)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def address_refusal(host: str, networks: tuple[Network, ...]) -> str | None:
    """Why ``host`` may not become an Envoy endpoint, or None when it may. It must be an IP address (EDS takes
    no names, and a name could later resolve anywhere) inside one of ``networks``; an IPv4-mapped IPv6
    address is judged as the IPv4 address it carries."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"host {host!r} is not an IP address; register the worker by its IP"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in networks):
        return None
    return (f"address {address} is outside controller.allowed_networks; add its network there if this "
            "worker is yours")


REGISTRATION_LAG_BOUND_S = 0.25
"""While the loop runs this far behind, new registrations are put off (``controller.overload``); heartbeats
never are. Well inside the default TTL (1.5 s), so a heartbeat already waiting still lands in time."""
REGISTRATION_RETRY_AFTER_S = 1
"""The shortest ``Retry-After`` a put-off registration is answered with."""
REGISTRATION_RETURNS_PER_S = 200
"""Put-off registrations are told to come back spread over their number (in the last second) divided by this:
10,000 at once come back over ~50 s, not together one second later."""


class RegistryApi:
    """Routes for the registry over the fleet store; the token check is constant-time. ``scaling`` holds
    the pools operators may scale (``autoscale.pools``); with ``lag`` (the loop's), registrations wait while
    the controller runs behind. The workers' calls (``register``, ``heartbeat``, ``heartbeat_batch``) answer
    whatever server took them: the controller's aiohttp routes here, or an API process's lean front. Each of
    those answers names the worker's next heartbeat interval and TTL, paced to the fleet in Redis
    (``controller.heartbeat_interval``); ``draw`` is the jitter's random source."""

    def __init__(self, store: FleetStore, token: str, pools: Sequence[PoolSpec], settings: ControllerSettings,
                 scaling: Mapping[str, PoolScaling] | None = None, instances: InstanceController | None = None,
                 metrics: CollectorRegistry | None = None, lag: LoopLag | None = None,
                 draw: Callable[[], float] = random.random) -> None:
        self._store = store
        self._token = token.encode()
        self._pools = {pool.name: pool for pool in pools}
        self.pace = HeartbeatPace(floor_s=settings.heartbeat_interval_s,
                                  grace_s=settings.heartbeat_ttl_s - settings.heartbeat_interval_s,
                                  calls_per_s_per_process=settings.max_heartbeats_per_s,
                                  api_processes=settings.api_process_count())
        self.fleet = FleetCount(store)
        """The fleet's size the intervals are paced to (Redis's, so a restarted registry paces at once)."""
        self._draw = draw
        self.heartbeats = HeartbeatCoalescer(store)
        """Heartbeats, single and batched, gathered into one Redis pipeline per batch."""
        self.registrations = RegistrationCoalescer(store, self._ttl_s)
        """Registrations, gathered into one pipeline and one announcement per batch."""
        self._lag = lag
        self._deferred_at: collections.deque[float] = collections.deque()
        self.registrations_deferred = 0
        """Registrations answered 503 because the loop ran behind (for tests and the benchmark)."""
        self._scaling = scaling or {}
        self._instances = instances
        self._metrics = metrics
        self._networks = tuple(ipaddress.ip_network(n) for n in settings.allowed_networks)

    def _ttl_s(self) -> float:
        """The TTL written with a registration: it covers the longest interval handed to a worker at this size."""
        return next_beat(self.pace, self.fleet.last_known, 1.0).ttl_s

    async def next_interval(self, workers_per_call: int = 1) -> NextBeat:
        """The interval and TTL for a call that beats ``workers_per_call`` workers (a node's batch: more)."""
        return next_beat(self.pace, await self.fleet.workers(), self._draw(), workers_per_call)

    async def say_it_serves(self, stop: asyncio.Event) -> None:
        """Until ``stop``, tell the fleet's readers every ``REGISTRY_ALIVE_S`` that this registry takes heartbeats,
        so that they hold the workers that go overdue while it does not (restarting, stalled) instead of
        expiring them into a storm of re-registrations (``store_scripts.REGISTRY_ALIVE_S``)."""
        while not stop.is_set():
            with contextlib.suppress(*REDIS_ERRORS):  # Redis away: the heartbeats' own writes fail and say so
                await self._store.registry_serves(self._ttl_s())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REGISTRY_ALIVE_S)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_get("/v1/workers", self._list)
        app.router.add_post("/v1/workers", self._register)
        app.router.add_post("/v1/workers/{worker_id}/heartbeat", self._heartbeat)
        app.router.add_post("/v1/heartbeats", self._heartbeats)
        app.router.add_delete("/v1/workers/{worker_id}", self._deregister)
        app.router.add_post("/v1/workers/{worker_id}/drain", self._drain)
        app.router.add_post("/v1/pools/{pool}/scale", self._scale)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if not self.authorized(request.headers.get("Authorization", "")):
            return response(UNAUTHORIZED)
        return await handler(request)

    def authorized(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header carries the controller token (compared in constant time)."""
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)

    async def _healthz(self, request: web.Request) -> web.Response:
        return response(HEALTHY)

    async def _metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics) if self._metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _list(self, request: web.Request) -> web.Response:
        workers = await self._store.read_fleet()
        return _json({"workers": [w.to_redis() for w in workers]})

    async def _body(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"malformed JSON: {exc}") from exc

    async def _register(self, request: web.Request) -> web.Response:
        return response(await self.register(await request.read()))

    async def register(self, body: bytes) -> Answer:
        """``POST /v1/workers``: a worker joins its pool (201 with its record), or is told why not."""
        lag_s = self._lag.lag_s if self._lag is not None else 0.0
        if lag_s > REGISTRATION_LAG_BOUND_S:
            self.registrations_deferred += 1
            retry_after = self._retry_after()
            return dataclasses.replace(error_answer(503, f"registry busy (event loop {lag_s * 1000:.0f} ms behind); "
                                                         f"register again after {retry_after} s", "registry_busy"),
                                       retry_after=retry_after)
        try:
            asked = Registration.model_validate_json(body)
        except ValidationError as exc:
            return error_answer(400, str(exc), "invalid_registration")
        pool = self._pools.get(asked.pool)
        if pool is None:
            return error_answer(400, f"unknown pool {asked.pool!r}; known: {', '.join(self._pools)}", "unknown_pool")
        refusal = address_refusal(asked.host, self._networks)
        if refusal is not None:
            log.warning("refused registration of worker %s: %s", asked.id, refusal)
            return error_answer(403, refusal, "address_not_allowed")
        record = WorkerRecord(
            id=asked.id, pool=pool.name, model=asked.model or pool.model, host=asked.host, port=asked.port,
            served_names=asked.served_names, max_model_len=asked.max_model_len or pool.max_model_len,
            backend=asked.backend, state=asked.state, node=asked.node or "",
            kv_events_endpoint=asked.kv_events_endpoint, kv_events_replay_endpoint=asked.kv_events_replay_endpoint,
        )
        beat = await self.next_interval()
        self.fleet.joined(1)
        await self.registrations.register(record)
        log.info("registered worker %s (%s) in pool %s", record.id, record.address, record.pool)
        return Answer(201, orjson.dumps({**record.to_redis(), **_pace_fields(beat)}))

    def _retry_after(self) -> int:
        """Whole seconds, drawn so that the registrations put off lately come back spread at about
        ``REGISTRATION_RETURNS_PER_S`` (a fleet told "1 s" all at once would come back all at once)."""
        now = time.monotonic()
        self._deferred_at.append(now)
        while self._deferred_at[0] < now - 1.0:
            self._deferred_at.popleft()
        spread_s = len(self._deferred_at) / REGISTRATION_RETURNS_PER_S
        return math.ceil(random.uniform(REGISTRATION_RETRY_AFTER_S, REGISTRATION_RETRY_AFTER_S + spread_s))

    async def _heartbeat(self, request: web.Request) -> web.Response:
        return response(await self.heartbeat(request.match_info["worker_id"], await request.read()))

    async def heartbeat(self, worker_id: str, body: bytes) -> Answer:
        """``POST /v1/workers/{id}/heartbeat``: the worker is alive, with the facts it reports (no body: none)."""
        try:
            facts = HEARTBEAT.validate_json(body) if body else {}
        except ValidationError as exc:
            return error_answer(400, str(exc), "invalid_heartbeat")
        beat = await self.next_interval()
        if not await self.heartbeats.beat(worker_id, _reported(facts), beat.ttl_s):
            return error_answer(404, f"worker {worker_id!r} is not registered (expired?); register again",
                                "not_registered")
        return Answer(200, orjson.dumps({"ok": True, **_pace_fields(beat)}))

    async def _heartbeats(self, request: web.Request) -> web.Response:
        return response(await self.heartbeat_batch(await request.read()))

    async def heartbeat_batch(self, body: bytes) -> Answer:
        """``POST /v1/heartbeats``: heartbeats of many workers in one call, written with the other calls of the
        same turn (one Redis command per ``FACTS_PER_CALL`` workers); the answer names the workers that are not
        registered (expired), which must register again."""
        try:  # parsed and checked in one pass over the bytes: this is the API's busiest call
            batch = HEARTBEAT_BATCH.validate_json(body)
        except ValidationError as exc:
            return error_answer(400, str(exc), "invalid_heartbeat")
        beats = {beat["id"]: _reported(beat) if len(beat) > 1 else {} for beat in batch["workers"]}
        pace = await self.next_interval(max(1, len(beats)))
        missing = await self.heartbeats.beat_many(beats, pace.ttl_s)
        return Answer(200, orjson.dumps({"ok": len(beats) - len(missing), "not_registered": missing,
                                         **_pace_fields(pace)}))

    async def _deregister(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        await self._store.deregister(worker_id)
        log.info("deregistered worker %s", worker_id)
        return web.Response(status=204)

    def _instances_orerror_response(self) -> InstanceController | web.Response:
        if self._instances is None:
            return error_response(501, "this controller does not manage instances", "not_supported")
        return self._instances

    async def _drain(self, request: web.Request) -> web.Response:
        """Start draining a worker; 202 at once (``?wait=1`` answers when the drain is over)."""
        instances = self._instances_orerror_response()
        if isinstance(instances, web.Response):
            return instances
        worker_id = request.match_info["worker_id"]
        try:
            started = await instances.drain(worker_id)
        except NotLeader as exc:
            return error_response(409, str(exc), "not_leader")
        if not started:
            return error_response(404, f"worker {worker_id!r} is not registered", "not_registered")
        if request.query.get("wait") in ("1", "true"):
            reason = await instances.drainer.wait(worker_id)
            return _json({"worker": worker_id, "state": "drained", "reason": reason})
        return _json({"worker": worker_id, "state": "Draining"}, status=202)

    async def _scale(self, request: web.Request) -> web.Response:
        instances = self._instances_orerror_response()
        if isinstance(instances, web.Response):
            return instances
        pool = request.match_info["pool"]
        scaling = self._scaling.get(pool)
        if scaling is None:
            return error_response(400, f"pool {pool!r} has no autoscale.pools entry (bounds and worker template)",
                          "not_scalable")
        try:
            body = await self._body(request)
            target = int(body["workers"])
        except (web.HTTPBadRequest, KeyError, TypeError, ValueError):
            return error_response(400, 'expected {"workers": N}', "invalid_scale")
        if not scaling.min_workers <= target <= scaling.max_workers:
            return error_response(400, f"pool {pool}: {target} is outside min_workers {scaling.min_workers} .. "
                          f"max_workers {scaling.max_workers}", "out_of_bounds")
        try:
            result = await instances.scale(pool, target)
        except NotLeader as exc:
            return error_response(409, str(exc), "not_leader")
        except PlacementRefused as exc:
            return error_response(409, str(exc), "placement_refused")
        return _json({"pool": pool, "before": result.before, "target": result.target,
                      "started": list(result.started), "draining": list(result.draining)})
