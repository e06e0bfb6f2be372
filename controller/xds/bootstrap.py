"""The Envoy bootstrap that ``poolgate up`` starts Envoy with: static listener, filters and routes; clusters
and endpoints come over ADS from the controller (``controller.xds``).

Request path: an early header mutation strips every client-sent routing header before anything looks at
the request (so a client never picks its own cluster or worker, even while extproc is away) → ``ext_proc``
(extproc sets the cluster header and the pin metadata, and clears the route cache) → router. Route 1
follows the cluster header; route 2 is the fail-open default to the fallback cluster, retrying 400s and 404s on
other hosts so a request finds a worker serving its model and endpoint.

With TLS towards the xDS or extproc servers, the clusters read ``tls.envoy``'s files through SDS files
(``controller.xds.envoy_tls``) that must exist before Envoy starts: ``write_sds_files`` writes them.

Built from protobuf messages (field names are checked) and rendered as a JSON/YAML-able dict. The
documented example is ``python -m controller.xds.bootstrap deploy/local.yaml > envoy/bootstrap.example.yaml``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.core.v3 import extension_pb2 as core_extension_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import any_pb2, duration_pb2, json_format, message, struct_pb2
from google.protobuf.wrappers_pb2 import BoolValue, UInt32Value

from controller.xds.build import relaxed_circuit_breakers
from controller.xds.envoy_tls import ClientSide, client_sides, upstream_tls
from poolgate.kernel.config import Config, TlsServerFiles
from poolgate.kernel.routing import (
    CLUSTER_HEADER,
    FALLBACK_CLUSTER,
    LB_METADATA_NAMESPACE,
    PD_SIDECAR_CLUSTER,
    ROUTING_HEADERS,
)

EXTPROC_CLUSTER = "poolgate-extproc"
XDS_CLUSTER = "poolgate-xds"
LISTENER_NAME = "poolgate-http"

HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

EXTPROC_MESSAGE_TIMEOUT_S = 3
"""How long Envoy waits for one ext_proc answer; extproc's parse and pick take about a millisecond."""
EXTPROC_HEALTH_INTERVAL_S = 0.5
"""How often Envoy asks each extproc process for its grpc.health.v1 status (several processes only)."""
EXTPROC_MAX_MESSAGE_TIMEOUT_S = 300
"""Upper bound for ``override_message_timeout``: the longest extproc may hold a request in its queue (a wait for
capacity is at most ``MAX_WAIT_LIMIT_S``, a cold start of a pool scaled to zero ``MAX_COLD_START_WAIT_S``)."""
UPSTREAM_FAILURE_LOG = "poolgate-upstream-failures"
"""The log name of the failed upstream attempts Envoy streams to the controllers
(``controller.xds.upstream_failures``)."""
UPSTREAM_LOG_FLUSH_S = 0.1
"""Envoy sends its buffered failure entries this often (its default, 1 s, would delay a passive ejection)."""
UPSTREAM_FAILURE_FLAGS = {"UF": "upstream_connection_failure", "UC": "upstream_connection_termination",
                          "UR": "upstream_remote_reset", "UT": "upstream_request_timeout"}
"""Envoy's response flags that blame the worker whatever the status code, each with its field in an access log
entry's ``response_flags`` (the controller reads the entries, ``controller.xds.upstream_failures``)."""
STREAM_IDLE_TIMEOUT_S = 600
"""A stream with no bytes for this long is reset; a slow model's gap between SSE tokens stays far below."""
BUFFER_HEADROOM_BYTES = 64 * 1024
"""Headers and framing on top of the largest accepted body."""
FALLBACK_404_RETRIES = 3
FALLBACK_HOST_SELECTIONS = 20
"""Draws a retry makes to find a host not tried yet: with ``v`` of ``n`` hosts tried, it lands on a tried one
with probability (v/n)^20 (0.3 % for the last untried host of 4; with 5 draws it was 24 %, and a fleet of four
single-worker models failed a fail-open request in a few tries)."""
FALLBACK_RETRY_CODES = (400, 404)
"""Answers of a worker that does not serve the request, on the fail-open route: 404, not its model; 400, not an
endpoint its kind of model serves (vLLM refuses embeddings on a chat model so). Another worker may."""
POOL_RETRY_ON = "connect-failure,refused-stream,reset"
"""Retry only while the response has not started: the connection failed, the HTTP/2 stream was refused, or
the upstream reset/disconnected before sending response headers (Envoy's ``reset``). Envoy never retries
once headers went downstream, so a stream cut mid-way ends with an error and is not replayed.
``reset-before-request`` alone is too narrow (measured): a request written to a pooled connection of a
worker killed a moment earlier dies with "connection termination" after it was sent and would fail. A
generation retried elsewhere costs GPU time twice but the client sees one answer."""
POOL_RETRIES = 2

REQUEST_ACCESS_LOG_FORMAT = (
    "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% "
    "%RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% ttfb=%RESPONSE_DURATION% "
    "cluster=%UPSTREAM_CLUSTER% host=%UPSTREAM_HOST% worker=%RESP(X-POOLGATE-WORKER)% "
    "tenant=%REQ(X-POOLGATE-TENANT)% details=%RESPONSE_CODE_DETAILS% id=%REQ(X-REQUEST-ID)% "
    "queue_wait_ms=%REQ(X-POOLGATE-QUEUE-WAIT-MS)% decision=\"%REQ(X-POOLGATE-DECISION):512%\" "
    "pd=\"%RESP(X-POOLGATE-PD)%\"\n"
)
"""One line per request. The pool is the cluster (``pool-<name>``, ``pool-<name>.<k>`` for a shard of a large
pool) and the worker the upstream host: the ``x-poolgate-cluster`` header is removed by the route before the
log is written. ``tenant`` is the header
extproc sets when tenants are configured; ``details`` is Envoy's reason for its own replies or extproc's
``poolgate_<code>`` for a refusal; ``queue_wait_ms`` how long extproc held the request (for capacity or while
a pool scaled to zero started a worker), ``-`` when it was placed at once; ``decision`` is the debug header
(``scheduling.debug_header``), else ``-``.
``worker`` is the response header a simulated worker sets (vLLM sets none). ``pd`` is the split of a request
the prefill/decode sidecar ran (prefill and decode worker, prefill time, KV tokens, fallback), else ``-``."""


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def _typed(name: str, config: message.Message) -> dict[str, Any]:
    """Keyword arguments for the many ``name`` + ``typed_config`` extension points."""
    packed = any_pb2.Any()
    packed.Pack(config)
    return {"name": name, "typed_config": packed}


def _local_cluster(name: str, ports: Sequence[int]) -> cluster_pb2.Cluster:
    """A static HTTP/2 cluster on localhost (gRPC needs HTTP/2; Envoy's default upstream is HTTP/1.1), one
    endpoint per port."""
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_duration(1),
        circuit_breakers=relaxed_circuit_breakers(),
        upstream_connection_options=cluster_pb2.UpstreamConnectionOptions(
            tcp_keepalive=address_pb2.TcpKeepalive(keepalive_time=UInt32Value(value=30))
        ),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=name),
    )
    locality = cluster.load_assignment.endpoints.add()
    for port in ports:
        endpoint = locality.lb_endpoints.add().endpoint
        endpoint.address.socket_address.address = "127.0.0.1"
        endpoint.address.socket_address.port_value = port
    options = http_protocol_options_pb2.HttpProtocolOptions()
    options.explicit_http_config.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(options)
    return cluster


def _with_tls(cluster: cluster_pb2.Cluster, envoy: ClientSide | None,
              server: TlsServerFiles | None) -> cluster_pb2.Cluster:
    """The cluster speaking TLS (``tls.envoy``'s files through SDS, ALPN h2 for gRPC) when its server serves
    TLS."""
    if server is not None and envoy is not None:
        cluster.transport_socket.CopyFrom(upstream_tls(envoy, alpn=("h2",)))
    return cluster


def _extproc_cluster(ports: Sequence[int]) -> cluster_pb2.Cluster:
    """One endpoint per extproc process. Envoy balances each ext_proc stream (one per HTTP request) over the
    endpoints, so several processes share the load evenly (measured: ``bench/extproc_overhead.py``);
    ``LEAST_REQUEST`` keeps a process holding many queued streams from getting more. With several processes
    a grpc.health.v1 check takes a killed or starting one out within ``EXTPROC_HEALTH_INTERVAL_S`` (its
    streams meanwhile fail open); every endpoint unhealthy means panic routing to all, i.e. fail-open."""
    cluster = _local_cluster(EXTPROC_CLUSTER, ports)
    if len(ports) > 1:
        cluster.lb_policy = cluster_pb2.Cluster.LEAST_REQUEST
        cluster.health_checks.append(health_check_pb2.HealthCheck(
            timeout=_duration(EXTPROC_HEALTH_INTERVAL_S),
            interval=_duration(EXTPROC_HEALTH_INTERVAL_S),
            unhealthy_threshold=UInt32Value(value=1),
            healthy_threshold=UInt32Value(value=1),
            grpc_health_check=health_check_pb2.HealthCheck.GrpcHealthCheck(),
        ))
    return cluster


def _pd_sidecar_cluster(port: int) -> cluster_pb2.Cluster:
    """The prefill/decode sidecar (``extproc/sidecar.py``): extproc names this cluster for split requests.
    HTTP/1.1 like the workers (the sidecar is an aiohttp server), one endpoint on this host."""
    cluster = _local_cluster(PD_SIDECAR_CLUSTER, [port])
    cluster.typed_extension_protocol_options.clear()
    return cluster


def _early_strip_routing_headers() -> core_extension_pb2.TypedExtensionConfig:
    """Runs before route selection. A ``header_mutation`` *filter* is too late (measured): the route, with
    the client's ``cluster_header`` value, is already chosen and kept when ext_proc fails open."""
    mutations = [mutation_rules_pb2.HeaderMutation(remove=name) for name in ROUTING_HEADERS]
    return core_extension_pb2.TypedExtensionConfig(**_typed(
        "envoy.http.early_header_mutation.header_mutation",
        early_header_mutation_pb2.HeaderMutation(mutations=mutations),
    ))


def _ext_proc(config: Config) -> hcm_pb2.HttpFilter:
    mode = processing_mode_pb2.ProcessingMode
    settings = config.extproc
    grpc_service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
            cluster_name=EXTPROC_CLUSTER,
            # extproc may rewrite a body (model alias), so its answers can be as large as a request.
            max_receive_message_length=UInt32Value(value=settings.max_request_bytes + BUFFER_HEADROOM_BYTES),
        )
    )
    filter_config = ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service,
        failure_mode_allow=settings.fail_open,
        processing_mode=mode(
            request_header_mode=mode.SEND,
            response_header_mode=mode.SKIP,
            request_body_mode=mode.BUFFERED,
            response_body_mode=mode.NONE,
            request_trailer_mode=mode.SKIP,
            response_trailer_mode=mode.SKIP,
        ),
        message_timeout=_duration(EXTPROC_MESSAGE_TIMEOUT_S),
        max_message_timeout=_duration(EXTPROC_MAX_MESSAGE_TIMEOUT_S),
        mutation_rules=mutation_rules_pb2.HeaderMutationRules(allow_all_routing=BoolValue(value=True)),
        # Without this namespace Envoy silently drops extproc's pin and the fallback policy picks.
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(untyped=[LB_METADATA_NAMESPACE])
        ),
        # extproc asks for the response (mode_override on its request-headers answer) only for requests whose
        # response it must read: usage of tenants with a tokens-per-minute limit, the public model name of a
        # catalogue version, the GenAI metrics. Every other request keeps response headers SKIP and body NONE,
        # so allowing the override costs nothing where it is not used.
        allow_mode_override=True,
    )
    if not settings.fail_open:
        filter_config.status_on_error.CopyFrom(http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable))
    return hcm_pb2.HttpFilter(**_typed("envoy.filters.http.ext_proc", filter_config))


def _other_hosts() -> list[route_components_pb2.RetryPolicy.RetryHostPredicate]:
    return [route_components_pb2.RetryPolicy.RetryHostPredicate(
        **_typed("envoy.retry_host_predicates.previous_hosts", previous_hosts_pb2.PreviousHostsPredicate())
    )]


def pool_retry_policy() -> route_components_pb2.RetryPolicy:
    """Another worker of the pool when the chosen one could not take the request (never the same one)."""
    return route_components_pb2.RetryPolicy(
        retry_on=POOL_RETRY_ON,
        num_retries=UInt32Value(value=POOL_RETRIES),
        retry_host_predicate=_other_hosts(),
        host_selection_retry_max_attempts=5,
    )


def worker_key_header(key_env: str | None) -> list[base_pb2.HeaderValueOption]:
    """The workers' API key, read by Envoy from its own environment when it starts (never written into a
    config), replacing whatever the request carried: a client's key is for poolgate, never for a worker."""
    if key_env is None:
        return []
    return [base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="authorization", value=f"Bearer %ENVIRONMENT({key_env})%"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )]


def _routes(worker_key_env: str | None) -> route_pb2.RouteConfiguration:
    by_header = route_components_pb2.Route(
        name="pool",
        match=route_components_pb2.RouteMatch(
            prefix="/",
            headers=[route_components_pb2.HeaderMatcher(name=CLUSTER_HEADER, present_match=True)],
        ),
        route=route_components_pb2.RouteAction(cluster_header=CLUSTER_HEADER, timeout=_duration(0),
                                               retry_policy=pool_retry_policy()),
        request_headers_to_remove=[CLUSTER_HEADER],  # routing detail; workers need not see it
        request_headers_to_add=worker_key_header(worker_key_env),
    )
    retry = route_components_pb2.RetryPolicy(
        retry_on="retriable-status-codes",
        retriable_status_codes=list(FALLBACK_RETRY_CODES),
        num_retries=UInt32Value(value=FALLBACK_404_RETRIES),
        retry_host_predicate=_other_hosts(),
        host_selection_retry_max_attempts=FALLBACK_HOST_SELECTIONS,
    )
    fail_open = route_components_pb2.Route(
        name="fail-open",
        match=route_components_pb2.RouteMatch(prefix="/"),
        route=route_components_pb2.RouteAction(cluster=FALLBACK_CLUSTER, timeout=_duration(0), retry_policy=retry),
        # extproc removes the client's key from what it routes; without extproc this route must do it.
        request_headers_to_remove=["authorization"],
        request_headers_to_add=worker_key_header(worker_key_env),
    )
    host = route_components_pb2.VirtualHost(name="poolgate", domains=["*"], routes=[by_header, fail_open])
    # The clusters arrive later over CDS; a static route table would otherwise be refused at start.
    return route_pb2.RouteConfiguration(name="poolgate", virtual_hosts=[host], validate_clusters=BoolValue(value=False))


def _openai_error(error_type: str) -> substitution_format_string_pb2.SubstitutionFormatString:
    body = struct_pb2.Struct()
    body.update({"error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type, "code": "%RESPONSE_CODE%"}})
    return substitution_format_string_pb2.SubstitutionFormatString(
        json_format=body, content_type="application/json"
    )


ENVOY_OWN_REPLY = "response.code_details != '' && !response.code_details.startsWith('poolgate')"
"""CEL: a local reply Envoy made itself. extproc's ImmediateResponse carries empty or ``poolgate…`` details
and a finished OpenAI JSON body, which must pass untouched (else it would be wrapped a second time)."""


def _local_reply() -> hcm_pb2.LocalReplyConfig:
    """Envoy's own replies (413, 503 no healthy upstream, 504 …) as OpenAI-style JSON errors."""
    envoy_own = accesslog_pb2.AccessLogFilter(extension_filter=accesslog_pb2.ExtensionFilter(**_typed(
        "envoy.access_loggers.extension_filters.cel", cel_pb2.ExpressionFilter(expression=ENVOY_OWN_REPLY)
    )))
    client_error = accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(
            op=accesslog_pb2.ComparisonFilter.LE,
            value=base_pb2.RuntimeUInt32(default_value=499, runtime_key="poolgate.client_error_max"),
        )
    ))
    as_is = substitution_format_string_pb2.SubstitutionFormatString(
        text_format_source=base_pb2.DataSource(inline_string="%LOCAL_REPLY_BODY%"),
        content_type="application/json",
    )
    return hcm_pb2.LocalReplyConfig(
        mappers=[
            hcm_pb2.ResponseMapper(
                filter=accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(
                    filters=[envoy_own, client_error]
                )),
                body_format_override=_openai_error("invalid_request_error"),
            ),
            hcm_pb2.ResponseMapper(filter=envoy_own, body_format_override=_openai_error("server_error")),
        ],
        body_format=as_is,
    )


def _access_log(path: str | None) -> accesslog_pb2.AccessLog:
    text = substitution_format_string_pb2.SubstitutionFormatString(
        text_format_source=base_pb2.DataSource(inline_string=REQUEST_ACCESS_LOG_FORMAT)
    )
    if path is None:
        return accesslog_pb2.AccessLog(**_typed("envoy.access_loggers.stdout", stream_pb2.StdoutAccessLog(
            log_format=text)))
    return accesslog_pb2.AccessLog(**_typed("envoy.access_loggers.file", file_pb2.FileAccessLog(
        path=path, log_format=text)))


def _upstream_failure_log() -> accesslog_pb2.AccessLog:
    """Each upstream attempt that failed (5xx from the worker, or a flag that blames it), streamed over the xDS
    cluster to the controllers' access log service: the health monitor's passive signal from every Envoy."""
    server_error = accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(
            op=accesslog_pb2.ComparisonFilter.GE,
            value=base_pb2.RuntimeUInt32(default_value=500, runtime_key="poolgate.upstream_failure_min_status"),
        )
    ))
    blamed = accesslog_pb2.AccessLogFilter(response_flag_filter=accesslog_pb2.ResponseFlagFilter(
        flags=list(UPSTREAM_FAILURE_FLAGS)))
    grpc_log = als_pb2.HttpGrpcAccessLogConfig(common_config=als_pb2.CommonGrpcAccessLogConfig(
        log_name=UPSTREAM_FAILURE_LOG,
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=XDS_CLUSTER)),
        transport_api_version=config_source_pb2.V3,
        buffer_flush_interval=_duration(UPSTREAM_LOG_FLUSH_S),
    ))
    return accesslog_pb2.AccessLog(
        filter=accesslog_pb2.AccessLogFilter(or_filter=accesslog_pb2.OrFilter(filters=[server_error, blamed])),
        **_typed("envoy.access_loggers.http_grpc", grpc_log),
    )


def _listener(
    config: Config, host: str, port: int, access_log: accesslog_pb2.AccessLog | None
) -> listener_pb2.Listener:
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix="poolgate",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=_routes(config.worker_api_key_env),
        http_filters=[
            _ext_proc(config),
            hcm_pb2.HttpFilter(**_typed("envoy.filters.http.router", router_pb2.Router(
                upstream_log=[_upstream_failure_log()]))),
        ],
        early_header_mutation_extensions=[_early_strip_routing_headers()],
        stream_idle_timeout=_duration(STREAM_IDLE_TIMEOUT_S),
        local_reply_config=_local_reply(),
        access_log=[access_log] if access_log is not None else [],
        # The id in extproc's logs and the access log, returned so a client can quote it.
        always_set_request_id_in_response=True,
    )
    listener = listener_pb2.Listener(
        name=LISTENER_NAME,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port)),
        # BUFFERED ext_proc holds the whole body in this buffer; the 1 MiB default answers 413 to long prompts.
        per_connection_buffer_limit_bytes=UInt32Value(
            value=config.extproc.max_request_bytes + BUFFER_HEADROOM_BYTES
        ),
    )
    chain = listener.filter_chains.add()
    chain.filters.append(listener_components_pb2.Filter(
        **_typed("envoy.filters.network.http_connection_manager", manager)
    ))
    return listener


def build_bootstrap(
    config: Config,
    *,
    node_id: str,
    listen_port: int,
    admin_port: int,
    extproc_port: int | Sequence[int],
    xds_port: int | Sequence[int],
    access_log_path: str | None = None,
    listen_host: str = "127.0.0.1",
    access_log: bool = False,
    pd_sidecar_port: int | None = None,
) -> bootstrap_pb2.Bootstrap:
    """The bootstrap as a protobuf message (``render_bootstrap`` gives the dict Envoy reads); ``extproc_port``
    may list one port per extproc process, ``xds_port`` one per controller (every controller serves the same
    xDS: Envoy holds its ADS stream to one and reconnects to another when that one goes); ``pd_sidecar_port``
    adds the prefill/decode sidecar's cluster."""
    log = _access_log(access_log_path) if (access_log or access_log_path) else None
    envoy_side, _ = client_sides(config.tls)
    bootstrap = bootstrap_pb2.Bootstrap(
        node=base_pb2.Node(id=node_id, cluster="poolgate"),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[_listener(config, listen_host, listen_port, log)],
            clusters=[_with_tls(_extproc_cluster(_ports(extproc_port)), envoy_side, config.tls.extproc),
                      _with_tls(_local_cluster(XDS_CLUSTER, _ports(xds_port)), envoy_side, config.tls.xds)],
        ),
        dynamic_resources=bootstrap_pb2.Bootstrap.DynamicResources(
            ads_config=config_source_pb2.ApiConfigSource(
                api_type=config_source_pb2.ApiConfigSource.DELTA_GRPC,
                transport_api_version=config_source_pb2.V3,
                grpc_services=[grpc_service_pb2.GrpcService(
                    envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=XDS_CLUSTER)
                )],
                set_node_on_first_message_only=True,
            ),
            cds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
            ),
        ),
    )
    if pd_sidecar_port is not None:
        bootstrap.static_resources.clusters.append(_pd_sidecar_cluster(pd_sidecar_port))
    bootstrap.admin.address.socket_address.address = "127.0.0.1"
    bootstrap.admin.address.socket_address.port_value = admin_port
    return bootstrap


def render_bootstrap(
    config: Config,
    *,
    node_id: str,
    listen_port: int,
    admin_port: int,
    extproc_port: int | Sequence[int],
    xds_port: int | Sequence[int],
    access_log_path: str | None = None,
    listen_host: str = "127.0.0.1",
    access_log: bool = False,
    pd_sidecar_port: int | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap as a plain dict; dump it as YAML or JSON for ``envoy -c`` / ``--config-yaml``.

    ``access_log_path`` writes one line per request to that file; ``access_log=True`` without a path logs
    to stdout. ``listen_host`` is ``0.0.0.0`` to accept clients from other machines.
    """
    bootstrap = build_bootstrap(
        config, node_id=node_id, listen_port=listen_port, admin_port=admin_port, extproc_port=extproc_port,
        xds_port=xds_port, access_log_path=access_log_path, listen_host=listen_host, access_log=access_log,
        pd_sidecar_port=pd_sidecar_port,
    )
    rendered: dict[str, Any] = json.loads(
        json_format.MessageToJson(bootstrap, preserving_proto_field_name=True, sort_keys=True)  # stable text
    )
    return rendered  # via JSON text: MessageToDict leaves OrderedDicts inside Any fields, which YAML refuses


def _ports(port: int | Sequence[int]) -> list[int]:
    return [port] if isinstance(port, int) else list(port)


EXAMPLE_HEADER = (
    "# Generated from {source} by `python -m controller.xds.bootstrap {source}`; do not edit by hand.\n"
    "# `poolgate up` renders the same bootstrap with the ports it picked. See envoy/README.md.\n"
)


def render_example(config: Config, source: str) -> str:
    """The documented example bootstrap (fixed ports) as YAML text."""
    import yaml

    rendered = render_bootstrap(config, node_id="poolgate-local", listen_port=8080, admin_port=9901,
                                extproc_port=9002, xds_port=18000)
    return EXAMPLE_HEADER.format(source=source) + yaml.safe_dump(rendered, sort_keys=False, width=120)


if __name__ == "__main__":
    import sys

    from poolgate.kernel.config import load_config

    source = sys.argv[1] if len(sys.argv) > 1 else "deploy/local.yaml"
    sys.stdout.write(render_example(load_config(source), source))
