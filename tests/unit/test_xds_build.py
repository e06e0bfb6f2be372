"""Fleet → Envoy resources: names, load-balancing policy, health mapping, determinism."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2

from controller.xds import XdsServer
from controller.xds.build import ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.snapshots import FALLBACK_PERIOD_S
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import DESTINATION_ENDPOINT_KEY, FALLBACK_CLUSTER, LB_METADATA_NAMESPACE, cluster_name

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))


def worker(worker_id: str, pool: str = "chat", port: int = 9000, state: WorkerState = WorkerState.READY,
           host: str = "10.0.0.1") -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool=pool, model="llama", host=host, port=port, state=state)


def hosts(assignment: endpoint_pb2.ClusterLoadAssignment) -> dict[str, int]:
    """``ip:port`` → health status of every endpoint in a load assignment."""
    return {
        f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}": e.health_status
        for locality in assignment.endpoints for e in locality.lb_endpoints
    }


def by_name(assignments: list[endpoint_pb2.ClusterLoadAssignment]) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
    return {a.cluster_name: a for a in assignments}


def test_one_cluster_per_pool_plus_fallback() -> None:
    clusters = build_clusters(POOLS)
    assert [c.name for c in clusters] == [cluster_name("chat"), cluster_name("code"), FALLBACK_CLUSTER]
    for cluster in clusters:
        assert cluster.type == cluster_pb2.Cluster.EDS
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        assert cluster.connect_timeout.seconds > 0
        assert cluster.common_lb_config.HasField("healthy_panic_threshold")
        assert cluster.common_lb_config.healthy_panic_threshold.value == 0
        assert cluster.circuit_breakers.thresholds[0].max_requests.value > 1024


def test_a_sharded_pool_is_one_pinning_cluster_per_shard() -> None:
    """A pool with ``endpoint_shards: 3`` is three clusters, each pinning like a pool's own (extproc names the
    worker's shard in the cluster header); the unsharded pool keeps its plain name."""
    clusters = build_clusters((POOLS[0], PoolSpec(name="big", model="llama", endpoint_shards=3)))
    assert [c.name for c in clusters] == [cluster_name("chat"), "pool-big.0", "pool-big.1", "pool-big.2",
                                          FALLBACK_CLUSTER]
    for cluster in clusters[1:4]:
        assert cluster.load_balancing_policy == clusters[0].load_balancing_policy
        assert cluster.outlier_detection == clusters[0].outlier_detection


def test_pool_cluster_pins_from_metadata_only_with_least_request_fallback() -> None:
    policy = build_clusters(POOLS)[0].load_balancing_policy.policies[0].typed_extension_config
    assert policy.name == "envoy.load_balancing_policies.override_host"
    config = override_host_pb2.OverrideHost()
    assert policy.typed_config.Unpack(config)
    [source] = config.override_host_sources
    assert not source.header  # a header source would let a client pin itself
    assert source.metadata.key == LB_METADATA_NAMESPACE
    assert [p.key for p in source.metadata.path] == [DESTINATION_ENDPOINT_KEY]
    fallback = config.fallback_policy.policies[0].typed_extension_config
    assert fallback.name == "envoy.load_balancing_policies.least_request"
    assert fallback.typed_config.Is(least_request_pb2.LeastRequest.DESCRIPTOR)


def test_fallback_cluster_is_least_request() -> None:
    policy = build_clusters(POOLS)[-1].load_balancing_policy.policies[0].typed_extension_config
    assert policy.name == "envoy.load_balancing_policies.least_request"


@pytest.mark.parametrize(("state", "health"), [
    (WorkerState.READY, health_check_pb2.HEALTHY),
    (WorkerState.BUSY, health_check_pb2.HEALTHY),
    (WorkerState.DRAINING, health_check_pb2.DRAINING),
    (WorkerState.FAILED, health_check_pb2.UNHEALTHY),
    (WorkerState.STARTING, health_check_pb2.UNHEALTHY),
])
def test_health_mapping(state: WorkerState, health: int) -> None:
    assignments = by_name(build_endpoints(POOLS, [worker("w1", state=state)]))
    assert hosts(assignments[cluster_name("chat")]) == {"10.0.0.1:9000": health}
    assert hosts(assignments[FALLBACK_CLUSTER]) == {"10.0.0.1:9000": health}


def test_endpoints_per_pool_and_fallback_holds_all() -> None:
    fleet = [worker("a", port=1), worker("b", port=2, state=WorkerState.DRAINING), worker("c", "code", port=3)]
    assignments = build_endpoints(POOLS, fleet)
    assert [a.cluster_name for a in assignments] == [cluster_name("chat"), cluster_name("code"), FALLBACK_CLUSTER]
    named = by_name(assignments)
    assert hosts(named[cluster_name("chat")]) == {
        "10.0.0.1:1": health_check_pb2.HEALTHY, "10.0.0.1:2": health_check_pb2.DRAINING}
    assert hosts(named[cluster_name("code")]) == {"10.0.0.1:3": health_check_pb2.HEALTHY}
    assert set(hosts(named[FALLBACK_CLUSTER])) == {"10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3"}
    endpoint = named[cluster_name("code")].endpoints[0].lb_endpoints[0].endpoint
    assert endpoint.hostname == "c"  # shows in Envoy's admin /clusters


def test_empty_fleet_still_has_every_assignment() -> None:
    assignments = build_endpoints(POOLS, [])
    assert [a.cluster_name for a in assignments] == [cluster_name("chat"), cluster_name("code"), FALLBACK_CLUSTER]
    assert all(hosts(a) == {} for a in assignments)


def test_output_does_not_depend_on_input_order() -> None:
    fleet = [worker("a", port=1), worker("b", port=2), worker("c", "code", port=3)]
    forward = [a.SerializeToString(deterministic=True) for a in build_endpoints(POOLS, fleet)]
    backward = [a.SerializeToString(deterministic=True) for a in build_endpoints(POOLS, fleet[::-1])]
    assert forward == backward


@pytest.mark.parametrize("bad", [
    worker("x", pool="unknown"),
    worker("x", host="worker-7.local"),
    worker("x", port=0),
    worker("x", port=70000),
])
def test_unusable_workers_are_left_out(bad: WorkerRecord) -> None:
    assignments = build_endpoints(POOLS, [bad, worker("ok", port=1)])
    assert all(set(hosts(a)) <= {"10.0.0.1:1"} for a in assignments)


def test_duplicate_address_becomes_one_host() -> None:
    assignments = by_name(build_endpoints(POOLS, [worker("a", port=1), worker("b", port=1)]))
    assert len(assignments[cluster_name("chat")].endpoints[0].lb_endpoints) == 1
    assert assignments[cluster_name("chat")].endpoints[0].lb_endpoints[0].endpoint.hostname == "a"


def test_ipv6_host_is_accepted() -> None:
    assignments = by_name(build_endpoints(POOLS, [worker("a", host="::1", port=1)]))
    assert hosts(assignments[cluster_name("chat")]) == {"::1:1": health_check_pb2.HEALTHY}


def test_the_fallback_kept_up_to_date_equals_the_one_built_at_once() -> None:
    pools = tuple(PoolSpec(name=f"p{i}", model="m") for i in (3, 1, 2))  # config order is not name order
    workers = [WorkerRecord(id=f"w{i:03d}", pool=f"p{i % 3 + 1}", model="m", host=f"10.0.0.{i + 1}", port=8000)
               for i in range(30)]
    now = [0.0]
    server = XdsServer(pools, clock=lambda: now[0])
    server.update(workers)
    changed = [*workers[:4], replace(workers[4], state=WorkerState.DRAINING), *workers[5:]]
    built = server.assignments_built
    now[0] += FALLBACK_PERIOD_S
    server.update(changed)
    assert server.assignments_built == built + 1  # one pool rebuilt; the fallback apart, in the next update
    assert server.fallback_due
    server.update(changed)
    assert server.assignments_built == built + 1 and not server.fallback_due
    assert fallback(server).SerializeToString(deterministic=True) == fallback_built(pools, changed).SerializeToString(
        deterministic=True)
    twice = [*changed, replace(workers[0], id="w999", pool="p2")]  # w000's address in a second pool too
    now[0] += FALLBACK_PERIOD_S
    server.update(twice)
    server.update(twice)
    assert fallback(server) == fallback_built(pools, twice)
    assert len(fallback(server).endpoints[0].lb_endpoints) == len(workers)  # one host per address


def test_a_change_sends_its_pool_at_once_and_the_fallback_apart_at_most_once_a_period() -> None:
    pools = (PoolSpec(name="a", model="m"), PoolSpec(name="b", model="m"))
    workers = [WorkerRecord(id=f"w{i}", pool="ab"[i % 2], model="m", host=f"10.0.1.{i + 1}", port=8000)
               for i in range(6)]
    now = [0.0]
    server = XdsServer(pools, clock=lambda: now[0])
    server.update(workers)
    before = fallback(server)
    now[0] += 0.1
    drained = [replace(workers[0], state=WorkerState.DRAINING), *workers[1:]]
    server.update(drained)
    statuses = {e.endpoint.hostname: e.health_status for e in assignment(server, "a").endpoints[0].lb_endpoints}
    assert statuses["w0"] != statuses["w2"]  # the pool shows the change at once
    assert fallback(server) == before and not server.fallback_due  # the fallback waits for its period
    now[0] += FALLBACK_PERIOD_S
    assert server.fallback_due
    server.update(drained)  # the bridge's next look, with nothing else changed
    assert fallback(server) == fallback_built(pools, drained) and not server.fallback_due


async def test_the_server_sends_a_stale_fallback_on_its_own() -> None:
    """On an event loop nobody needs to call again: the pool's change goes out at once, the fallback after it,
    in an update of its own, once its period has passed."""
    pools = (PoolSpec(name="a", model="m"),)
    workers = [WorkerRecord(id=f"w{i}", pool="a", model="m", host=f"10.0.2.{i + 1}", port=8000) for i in range(3)]
    server = XdsServer(pools, fallback_period_s=0.3)
    server.update(workers)
    before = fallback(server)
    await asyncio.sleep(0.35)  # the period has passed: the fallback is due, yet not sent with the change
    drained = [replace(workers[0], state=WorkerState.DRAINING), *workers[1:]]
    server.update(drained)
    assert fallback(server) == before
    assert assignment(server, "a") == by_name(build_endpoints(pools, drained))[cluster_name("a")]
    for _ in range(100):
        if fallback(server) != before:
            break
        await asyncio.sleep(0.01)
    assert fallback(server) == fallback_built(pools, drained)
    await server.stop()


def one_pool_server(workers: int, subnet: int, period_s: float) -> tuple[XdsServer, list[WorkerRecord]]:
    """A server (fallback quiet wait 0.2 s) that has sent one pool of ``workers``, and that pool's workers."""
    fleet = [WorkerRecord(id=f"w{i:02d}", pool="a", model="m", host=f"10.0.{subnet}.{i + 1}", port=8000)
             for i in range(workers)]
    server = XdsServer((PoolSpec(name="a", model="m"),), fallback_period_s=period_s, fallback_quiet_s=0.2)
    server.update(fleet)
    return server, fleet


def draining_from(workers: list[WorkerRecord], count: int) -> list[WorkerRecord]:
    """``workers`` with the first ``count`` of them Draining: each step of a burst changes one more."""
    return [replace(w, state=WorkerState.DRAINING) if i < count else w for i, w in enumerate(workers)]


async def test_a_due_fallback_waits_for_a_burst_of_changes_to_pass() -> None:
    """Changes 0.1 s apart: the due fallback is not sent among them (each would queue behind the whole fleet at
    every Envoy), but 0.2 s after the last."""
    server, workers = one_pool_server(20, subnet=3, period_s=1.0)
    before = fallback(server)
    await asyncio.sleep(1.05)  # due from here on
    for count in range(1, 6):
        server.update(draining_from(workers, count))
        await asyncio.sleep(0.1)
        assert fallback(server) == before, f"sent amid the burst, after change {count}"
    await asyncio.sleep(0.25)
    assert fallback(server) == fallback_built((PoolSpec(name="a", model="m"),), draining_from(workers, 5))
    await server.stop()


async def test_an_endless_burst_holds_the_fallback_one_period_at_most() -> None:
    server, workers = one_pool_server(60, subnet=4, period_s=0.3)
    before = fallback(server)
    await asyncio.sleep(0.35)
    loop = asyncio.get_running_loop()
    started = loop.time()
    count = 0
    while fallback(server) == before:
        assert count < len(workers), "never sent"
        count += 1
        server.update(draining_from(workers, count))
        await asyncio.sleep(0.05)
    took = loop.time() - started
    print(f"fallback sent {took:.2f} s into a burst of changes 0.05 s apart")
    assert took >= 0.25  # held past its due time, though its period had passed
    await server.stop()


def fallback_built(pools: tuple[PoolSpec, ...], workers: list[WorkerRecord]) -> endpoint_pb2.ClusterLoadAssignment:
    """The fallback's assignment built from the whole fleet at once."""
    return by_name(build_endpoints(pools, workers))[FALLBACK_CLUSTER]


def assignment(server: XdsServer, pool: str) -> endpoint_pb2.ClusterLoadAssignment:
    snapshot = server._cache.get(ENDPOINT_TYPE_URL)
    assert snapshot is not None
    resource = snapshot.resources[cluster_name(pool)]
    assert isinstance(resource, endpoint_pb2.ClusterLoadAssignment)
    return resource


def fallback(server: XdsServer) -> endpoint_pb2.ClusterLoadAssignment:
    snapshot = server._cache.get(ENDPOINT_TYPE_URL)
    assert snapshot is not None
    resource = snapshot.resources[FALLBACK_CLUSTER]
    assert isinstance(resource, endpoint_pb2.ClusterLoadAssignment)
    return resource
