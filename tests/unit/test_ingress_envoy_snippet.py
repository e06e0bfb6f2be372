"""The shipped snippets say what poolgate's own bootstrap says: same headers stripped, same ext_proc
contract, same access log. When the bootstrap changes, these fail until the snippets follow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2
from google.protobuf import json_format

from controller.xds.bootstrap import REQUEST_ACCESS_LOG_FORMAT, render_bootstrap
from poolgate.kernel.config import load_config
from poolgate.kernel.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE, ROUTING_HEADERS

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = yaml.safe_load((ROOT / "envoy" / "snippet" / "poolgate.yaml").read_text())
PINNED = yaml.safe_load((ROOT / "envoy" / "snippet" / "pinned-cluster.yaml").read_text())
ISTIO = yaml.safe_load((ROOT / "deploy" / "istio" / "envoyfilter.yaml").read_text())
K8S_ENVOY = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "envoy-bootstrap.yaml").read_text())


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    return manager


def reference_manager() -> dict[str, Any]:
    """poolgate's own listener (default settings), the source of truth for the snippets."""
    rendered = render_bootstrap(load_config(ROOT / "deploy" / "local.yaml"), node_id="n1", listen_port=8080,
                                admin_port=9901, extproc_port=9002, xds_port=18000, access_log=True)
    return _manager(rendered)


def _ext_proc(filters: list[dict[str, Any]]) -> dict[str, Any]:
    [ext_proc] = [f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
    return ext_proc


def _istio_patch(apply_to: str) -> dict[str, Any]:
    [value] = [p["patch"]["value"] for p in ISTIO["spec"]["configPatches"] if p["applyTo"] == apply_to]
    return value  # type: ignore[no-any-return]


EXT_PROC_CONTRACT = ("processing_mode", "metadata_options", "mutation_rules", "failure_mode_allow",
                     "message_timeout", "max_message_timeout")


@pytest.mark.parametrize("where", ["snippet", "istio", "kubernetes"])
def test_ext_proc_filter_matches_the_bootstrap(where: str) -> None:
    filters = {"snippet": SNIPPET["http_filters"], "istio": [_istio_patch("HTTP_FILTER")],
               "kubernetes": _manager(K8S_ENVOY)["http_filters"]}[where]
    shipped = _ext_proc(filters)
    reference = _ext_proc(reference_manager()["http_filters"])
    defaults = {"response_body_mode": "NONE"}  # proto3 JSON leaves enum zero values out
    for key in EXT_PROC_CONTRACT:
        expected = reference.get(key)
        if key == "processing_mode":
            expected = {**defaults, **(expected or {})}
        assert shipped.get(key) == expected, f"{where}: ext_proc {key} differs from controller/xds/bootstrap.py"
    limit = reference["grpc_service"]["envoy_grpc"]["max_receive_message_length"]
    assert shipped["grpc_service"]["envoy_grpc"]["max_receive_message_length"] == limit


def _removed(extensions: list[dict[str, Any]]) -> list[str]:
    return [m["remove"] for ext in extensions for m in ext["typed_config"]["mutations"]]


def test_every_routing_header_is_stripped_early() -> None:
    istio = _istio_patch("NETWORK_FILTER")["typed_config"]["early_header_mutation_extensions"]
    for extensions in (SNIPPET["early_header_mutation_extensions"], istio,
                       _manager(K8S_ENVOY)["early_header_mutation_extensions"]):
        assert _removed(extensions) == list(ROUTING_HEADERS)


def test_routes_follow_the_cluster_header_and_pinned_clusters_read_the_metadata_pin() -> None:
    pool, fail_open = SNIPPET["routes"]
    assert pool["match"]["headers"] == [{"name": CLUSTER_HEADER, "present_match": True}]
    assert pool["route"]["cluster_header"] == CLUSTER_HEADER
    assert "headers" not in fail_open["match"]
    for route in (PINNED["routes"][0], _istio_patch("HTTP_ROUTE")):
        assert route["match"]["headers"] == [{"name": CLUSTER_HEADER, "present_match": True}]
        assert route["route"]["cluster"] == "poolgate-pinned"
        assert route["request_headers_to_remove"] == [CLUSTER_HEADER]
    for cluster in (PINNED["clusters"][0], _istio_patch("CLUSTER")):
        key = cluster["original_dst_lb_config"]["metadata_key"]
        assert (key["key"], key["path"]) == (LB_METADATA_NAMESPACE, [{"key": DESTINATION_ENDPOINT_KEY}])
        json_format.ParseDict(cluster, cluster_pb2.Cluster())
    for route in (*SNIPPET["routes"], *PINNED["routes"]):
        json_format.ParseDict(route, route_components_pb2.Route())


def test_access_log_formats_agree() -> None:
    [log] = SNIPPET["access_log"]
    assert log["typed_config"]["log_format"]["text_format_source"]["inline_string"] == REQUEST_ACCESS_LOG_FORMAT
    assert _manager(K8S_ENVOY)["access_log"] == SNIPPET["access_log"]
    for field in ("%UPSTREAM_CLUSTER%", "%UPSTREAM_HOST%", "%REQ(X-POOLGATE-TENANT)%", "%RESPONSE_CODE_DETAILS%",
                  "%REQ(X-POOLGATE-DECISION):512%"):
        assert field in REQUEST_ACCESS_LOG_FORMAT


def test_kubernetes_bootstrap_carries_the_snippet() -> None:
    manager = _manager(K8S_ENVOY)
    assert manager["http_filters"][:-1] == SNIPPET["http_filters"]
    assert manager["route_config"]["virtual_hosts"][0]["routes"] == SNIPPET["routes"]
    assert K8S_ENVOY["dynamic_resources"] == SNIPPET["dynamic_resources"]
    assert [c["name"] for c in K8S_ENVOY["static_resources"]["clusters"]] == [c["name"] for c in SNIPPET["clusters"]]
    json_format.ParseDict(K8S_ENVOY, bootstrap_pb2.Bootstrap())


def _upstream_log(logs: list[dict[str, Any]]) -> list[accesslog_pb2.AccessLog]:
    return [json_format.ParseDict(log, accesslog_pb2.AccessLog()) for log in logs]


def _router_upstream_log(filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    [router] = [f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.router"]
    return router["upstream_log"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["snippet", "kubernetes"])
def test_failed_upstream_attempts_reach_the_controller_as_the_bootstrap_sends_them(where: str) -> None:
    shipped = (SNIPPET["upstream_log"] if where == "snippet"
               else _router_upstream_log(_manager(K8S_ENVOY)["http_filters"]))
    assert _upstream_log(shipped) == _upstream_log(_router_upstream_log(reference_manager()["http_filters"]))
