"""The ingress configs poolgate ships are accepted by the real Envoy (``envoy --mode validate``).

Each snippet is merged into a complete config the way docs/ingress.md tells a user to, then Envoy parses
and checks every field, extension and cross-reference without opening a port. The Istio EnvoyFilter's
patches are applied to a stand-in for an Istio gateway's config (listener, router, Istio-named clusters);
that checks the patch values, not Istio's own merging.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import load_config
from poolgate.procs import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = ROOT / "envoy" / "snippet"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def validate(config: dict[str, Any], tmp_path: Path, *extra: str) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    result = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path), "-l", "warning", *extra],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    return manager


def merge_snippet(existing: dict[str, Any], snippet: dict[str, Any], pinned: dict[str, Any] | None = None) -> (
        dict[str, Any]):
    """What docs/ingress.md asks of a user, done to their config. ``pinned``: the pinned-cluster variant."""
    config = copy.deepcopy(existing)
    listener = config["static_resources"]["listeners"][0]
    listener["per_connection_buffer_limit_bytes"] = 16842752
    manager = _manager(config)
    manager.setdefault("early_header_mutation_extensions", []).extend(snippet["early_header_mutation_extensions"])
    manager["http_filters"] = snippet["http_filters"] + manager["http_filters"]
    manager.setdefault("access_log", []).extend(snippet["access_log"])
    host = manager["route_config"]["virtual_hosts"][0]
    for route in host["routes"]:
        route.update(copy.deepcopy(snippet["disable_on_other_routes"]))
    routes = (pinned or snippet)["routes"]
    host["routes"] = routes + host["routes"]
    if pinned is None:
        router = next(f for f in manager["http_filters"] if f["name"] == ROUTER["name"])
        router["typed_config"].setdefault("upstream_log", []).extend(snippet["upstream_log"])
        config["static_resources"]["clusters"].extend(snippet["clusters"])
        config["dynamic_resources"] = snippet["dynamic_resources"]
        manager["route_config"]["validate_clusters"] = False  # pool clusters arrive over CDS
    else:
        extproc = [c for c in snippet["clusters"] if c["name"] == "poolgate-extproc"]
        workers = copy.deepcopy(config["static_resources"]["clusters"][0])
        workers["name"] = workers["load_assignment"]["cluster_name"] = "poolgate-workers"
        config["static_resources"]["clusters"].extend([*extproc, *pinned["clusters"], workers])
    return config


def test_snippet_in_an_existing_envoy(tmp_path: Path) -> None:
    validate(merge_snippet(_load(SNIPPET / "example-existing.yaml"), _load(SNIPPET / "poolgate.yaml")), tmp_path)


def test_pinned_cluster_variant_in_an_existing_envoy(tmp_path: Path) -> None:
    config = merge_snippet(_load(SNIPPET / "example-existing.yaml"), _load(SNIPPET / "poolgate.yaml"),
                           pinned=_load(SNIPPET / "pinned-cluster.yaml"))
    validate(config, tmp_path)


def test_kubernetes_envoy_bootstrap(tmp_path: Path) -> None:
    validate(_load(ROOT / "deploy" / "kubernetes" / "envoy-bootstrap.yaml"), tmp_path, "--service-node", "envoy-0")


@pytest.mark.parametrize("to_file", [False, True], ids=["stdout", "file"])
def test_bootstrap_access_log_format_is_accepted(tmp_path: Path, to_file: bool) -> None:
    # Envoy's validation opens the log file: one in the test's own directory, so nothing is left behind.
    access_log_path = str(tmp_path / "access.log") if to_file else None
    config = render_bootstrap(load_config(ROOT / "deploy" / "local.yaml"), node_id="validate", listen_port=8080,
                              admin_port=9901, extproc_port=9002, xds_port=18000, access_log=True,
                              access_log_path=access_log_path)
    validate(config, tmp_path)


def istio_gateway_stand_in() -> dict[str, Any]:
    """The parts of an Istio ingress gateway's config the EnvoyFilter patches touch, with Istio's names."""
    def cluster(name: str, address: str, port: int) -> dict[str, Any]:
        return {"name": name, "type": "STRICT_DNS", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": address, "port_value": port}}}}]}]}}

    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "outbound_0.0.0.0_8080",
        "route_config": {"name": "http.8080", "virtual_hosts": [{
            "name": "inference.example.com:80", "domains": ["inference.example.com", "inference.example.com:*"],
            "routes": [{"name": "openai", "match": {"prefix": "/v1/"}, "route": {
                "cluster": "outbound|8000||poolgate-workers.poolgate.svc.cluster.local", "timeout": "0s"}}],
        }]},
        "http_filters": [copy.deepcopy(ROUTER)],
    }
    extproc = cluster("outbound|9002||poolgate-extproc.poolgate.svc.cluster.local", "poolgate-extproc", 9002)
    extproc["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    return {
        "node": {"id": "router~10.0.0.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local",
                 "cluster": "istio-ingressgateway"},
        "static_resources": {
            "listeners": [{"name": "0.0.0.0_8080", "address": {"socket_address": {
                "address": "0.0.0.0", "port_value": 8080}}, "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}]}],
            "clusters": [extproc, cluster("outbound|8000||poolgate-workers.poolgate.svc.cluster.local",
                                          "poolgate-workers", 8000)],
        },
    }


def apply_envoy_filter(config: dict[str, Any], envoy_filter: dict[str, Any]) -> dict[str, Any]:
    """The patch operations the poolgate EnvoyFilter uses, applied as Istio applies them."""
    config = copy.deepcopy(config)
    listener = config["static_resources"]["listeners"][0]
    manager = _manager(config)
    for patch in envoy_filter["spec"]["configPatches"]:
        kind, operation, value = patch["applyTo"], patch["patch"]["operation"], copy.deepcopy(patch["patch"]["value"])
        if (kind, operation) == ("NETWORK_FILTER", "MERGE"):
            for key, item in value["typed_config"].items():
                if key != "@type":
                    manager.setdefault(key, []).extend(item)
        elif (kind, operation) == ("HTTP_FILTER", "INSERT_BEFORE"):
            assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER["name"]
            manager["http_filters"].insert(len(manager["http_filters"]) - 1, value)
        elif (kind, operation) == ("LISTENER", "MERGE"):
            listener.update(value)
        elif (kind, operation) == ("CLUSTER", "ADD"):
            config["static_resources"]["clusters"].append(value)
        elif (kind, operation) == ("HTTP_ROUTE", "INSERT_FIRST"):
            [host] = [h for h in manager["route_config"]["virtual_hosts"]
                      if h["name"] == patch["match"]["routeConfiguration"]["vhost"]["name"]]
            host["routes"].insert(0, value)
        else:
            raise AssertionError(f"patch {kind}/{operation} is not modelled by this test")
    return config


def test_istio_envoy_filter_patches_make_a_valid_gateway(tmp_path: Path) -> None:
    envoy_filter = _load(ROOT / "deploy" / "istio" / "envoyfilter.yaml")
    validate(apply_envoy_filter(istio_gateway_stand_in(), envoy_filter), tmp_path)
