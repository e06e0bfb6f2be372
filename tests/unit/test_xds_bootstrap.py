"""The rendered bootstrap: parses back into Envoy's schema and carries every setting the request path needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format

from controller.xds.bootstrap import EXTPROC_CLUSTER, XDS_CLUSTER, render_bootstrap, render_example
from poolgate.kernel.config import Config, load_config, parse_config
from poolgate.kernel.routing import CLUSTER_HEADER, FALLBACK_CLUSTER, LB_METADATA_NAMESPACE, ROUTING_HEADERS


def config(**extproc: Any) -> Config:
    return parse_config({"pools": [{"name": "chat", "model": "llama"}], "extproc": extproc})


def parsed(rendered: dict[str, Any]) -> bootstrap_pb2.Bootstrap:
    # Through YAML text and back into the proto: every field name and @type must be real.
    return json_format.ParseDict(yaml.safe_load(yaml.safe_dump(rendered)), bootstrap_pb2.Bootstrap())


def render(cfg: Config | None = None, **kwargs: Any) -> bootstrap_pb2.Bootstrap:
    return parsed(render_bootstrap(cfg or config(), node_id="gw-1", listen_port=8080, admin_port=9901,
                                   extproc_port=9002, xds_port=18000, **kwargs))


def manager(bootstrap: bootstrap_pb2.Bootstrap) -> hcm_pb2.HttpConnectionManager:
    [listener] = bootstrap.static_resources.listeners
    out = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(out)
    return out


def ext_proc(bootstrap: bootstrap_pb2.Bootstrap) -> ext_proc_pb2.ExternalProcessor:
    [flt] = [f for f in manager(bootstrap).http_filters if f.name == "envoy.filters.http.ext_proc"]
    out = ext_proc_pb2.ExternalProcessor()
    assert flt.typed_config.Unpack(out)
    return out


def test_node_admin_and_ads() -> None:
    bootstrap = render()
    assert bootstrap.node.id == "gw-1" and bootstrap.node.cluster
    assert (bootstrap.admin.address.socket_address.address, bootstrap.admin.address.socket_address.port_value) == (
        "127.0.0.1", 9901)
    ads = bootstrap.dynamic_resources.ads_config
    assert ads.api_type == config_source_pb2.ApiConfigSource.DELTA_GRPC
    assert ads.transport_api_version == config_source_pb2.V3
    assert ads.grpc_services[0].envoy_grpc.cluster_name == XDS_CLUSTER
    assert bootstrap.dynamic_resources.cds_config.HasField("ads")


@pytest.mark.parametrize(("name", "port"), [(EXTPROC_CLUSTER, 9002), (XDS_CLUSTER, 18000)])
def test_static_grpc_clusters_speak_http2(name: str, port: int) -> None:
    [cluster] = [c for c in render().static_resources.clusters if c.name == name]
    address = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.1", port)
    options = http_protocol_options_pb2.HttpProtocolOptions()
    cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_listener_address_and_buffer_above_the_largest_body(host: str) -> None:
    cfg = config(max_request_bytes=4 * 1024 * 1024)
    [listener] = render(cfg, listen_host=host).static_resources.listeners
    assert isinstance(listener, listener_pb2.Listener)
    assert (listener.address.socket_address.address, listener.address.socket_address.port_value) == (host, 8080)
    assert listener.per_connection_buffer_limit_bytes.value > cfg.extproc.max_request_bytes


def test_routing_headers_are_stripped_before_routing() -> None:
    [early] = manager(render()).early_header_mutation_extensions
    assert early.name == "envoy.http.early_header_mutation.header_mutation"
    mutation = header_mutation_pb2.HeaderMutation()
    assert early.typed_config.Unpack(mutation)
    assert [m.remove for m in mutation.mutations] == list(ROUTING_HEADERS)


def test_filter_order() -> None:
    assert [f.name for f in manager(render()).http_filters] == [
        "envoy.filters.http.ext_proc", "envoy.filters.http.router"]


@pytest.mark.parametrize("fail_open", [True, False])
def test_ext_proc_settings(fail_open: bool) -> None:
    cfg = config(fail_open=fail_open)
    filter_config = ext_proc(render(cfg))
    mode = processing_mode_pb2.ProcessingMode
    assert filter_config.grpc_service.envoy_grpc.cluster_name == EXTPROC_CLUSTER
    assert filter_config.grpc_service.envoy_grpc.max_receive_message_length.value > cfg.extproc.max_request_bytes
    assert filter_config.processing_mode == mode(
        request_header_mode=mode.SEND, response_header_mode=mode.SKIP, request_body_mode=mode.BUFFERED,
        response_body_mode=mode.NONE, request_trailer_mode=mode.SKIP, response_trailer_mode=mode.SKIP)
    assert filter_config.failure_mode_allow is fail_open
    if fail_open:
        assert not filter_config.HasField("status_on_error")
    else:
        assert filter_config.status_on_error.code == http_status_pb2.ServiceUnavailable
    assert filter_config.mutation_rules.allow_all_routing.value is True
    assert list(filter_config.metadata_options.receiving_namespaces.untyped) == [LB_METADATA_NAMESPACE]
    assert 2 <= filter_config.message_timeout.seconds <= 5
    assert filter_config.max_message_timeout.seconds >= 60
    assert filter_config.allow_mode_override is True  # extproc asks per request for what it must read


def test_routes_follow_the_cluster_header_then_fail_open() -> None:
    route_config = manager(render()).route_config
    assert route_config.validate_clusters.value is False  # clusters come later over CDS
    by_header, fail_open = route_config.virtual_hosts[0].routes
    assert by_header.match.prefix == "/"
    assert [(h.name, h.present_match) for h in by_header.match.headers] == [(CLUSTER_HEADER, True)]
    assert by_header.route.cluster_header == CLUSTER_HEADER
    assert by_header.route.HasField("timeout") and by_header.route.timeout.ToSeconds() == 0
    assert fail_open.match.prefix == "/" and not fail_open.match.headers
    assert fail_open.route.cluster == FALLBACK_CLUSTER
    retry = fail_open.route.retry_policy
    assert isinstance(retry, route_components_pb2.RetryPolicy)
    assert "retriable-status-codes" in retry.retry_on and list(retry.retriable_status_codes) == [400, 404]
    assert [p.name for p in retry.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
    assert retry.num_retries.value >= 2


def test_long_streams_are_not_cut() -> None:
    hcm = manager(render())
    assert hcm.stream_idle_timeout.seconds >= 300
    assert hcm.request_timeout.seconds == 0


def test_local_replies_are_openai_json() -> None:
    reply = manager(render()).local_reply_config
    formats = [m.body_format_override for m in reply.mappers]
    assert [f.json_format["error"]["type"] for f in formats] == ["invalid_request_error", "server_error"]
    for body_format in formats:
        assert body_format.content_type == "application/json"
        error = body_format.json_format["error"]
        assert (error["message"], error["code"]) == ("%LOCAL_REPLY_BODY%", "%RESPONSE_CODE%")
    assert reply.body_format.content_type == "application/json"  # extproc's own JSON passes as it is


@pytest.mark.parametrize(("path", "enabled", "logger"), [
    (None, False, None),
    (None, True, "envoy.access_loggers.stdout"),
    ("/var/log/envoy/access.log", False, "envoy.access_loggers.file"),
])
def test_access_log(path: str | None, enabled: bool, logger: str | None) -> None:
    logs = manager(render(access_log_path=path, access_log=enabled)).access_log
    assert [log.name for log in logs] == ([logger] if logger else [])
    if path:
        file_config = file_pb2.FileAccessLog()
        logs[0].typed_config.Unpack(file_config)
        assert file_config.path == path


def test_example_bootstrap_is_current() -> None:
    root = Path(__file__).resolve().parents[2]
    source = "deploy/local.yaml"
    expected = render_example(load_config(root / source), source)
    assert (root / "envoy" / "bootstrap.example.yaml").read_text() == expected, (
        f"envoy/bootstrap.example.yaml is stale: run `python -m controller.xds.bootstrap {source} "
        "> envoy/bootstrap.example.yaml`")


def test_a_client_key_never_reaches_a_worker_and_the_workers_key_is_read_from_envoys_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_KEY", "s3cr3t-worker-key")
    without_key = manager(render()).route_config.virtual_hosts[0].routes
    assert [list(r.request_headers_to_add) for r in without_key] == [[], []]
    assert list(without_key[1].request_headers_to_remove) == ["authorization"]  # extproc drops it on the other
    with_key = parse_config({"pools": [{"name": "chat", "model": "llama"}], "worker_api_key_env": "WORKER_KEY"})
    rendered = render_bootstrap(with_key, node_id="gw-1", listen_port=8080, admin_port=9901, extproc_port=9002,
                                xds_port=18000)
    assert "s3cr3t" not in yaml.safe_dump(rendered)  # the config names the variable; Envoy reads it
    for route in manager(parsed(rendered)).route_config.virtual_hosts[0].routes:
        [added] = route.request_headers_to_add
        assert (added.header.key, added.header.value) == ("authorization", "Bearer %ENVIRONMENT(WORKER_KEY)%")
        assert added.append_action == added.OVERWRITE_IF_EXISTS_OR_ADD
