"""deploy/istio: the shape of every Istio resource (field names and enums from Istio's networking API),
Envoy types for the EnvoyFilter's patch values, and names that agree with deploy/kubernetes.

No Istio runs here: this catches typos and drift, not Istio's own merging (the integration test applies
the patches to a stand-in gateway config and runs ``envoy --mode validate`` on it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401  (registers the Any type)
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from google.protobuf import json_format, message

ROOT = Path(__file__).resolve().parents[2]
ISTIO = ROOT / "deploy" / "istio"

Schema = dict[str, Any]
"""Field name → nested schema, or None for a leaf. Lists are checked item by item against the same schema."""

PORT: Schema = {"number": None, "protocol": None, "name": None, "targetPort": None}
TLS_SETTINGS: Schema = {k: None for k in ("mode", "clientCertificate", "privateKey", "caCertificates",
                                          "credentialName", "subjectAltNames", "sni", "insecureSkipVerify")}
TRAFFIC_POLICY: Schema = {
    "loadBalancer": {"simple": None, "consistentHash": None, "localityLbSetting": None, "warmup": None},
    "connectionPool": {
        "tcp": {k: None for k in ("maxConnections", "connectTimeout", "tcpKeepalive", "maxConnectionDuration",
                                  "idleTimeout")},
        "http": {k: None for k in ("http1MaxPendingRequests", "http2MaxRequests", "maxRequestsPerConnection",
                                   "maxRetries", "idleTimeout", "h2UpgradePolicy", "useClientProtocol",
                                   "maxConcurrentStreams")},
    },
    "outlierDetection": {k: None for k in ("splitExternalLocalOriginErrors", "consecutiveLocalOriginFailures",
                                           "consecutiveGatewayErrors", "consecutive5xxErrors", "interval",
                                           "baseEjectionTime", "maxEjectionPercent", "minHealthPercent")},
    "tls": TLS_SETTINGS,
    "portLevelSettings": None,
    "tunnel": None,
    "proxyProtocol": None,
}
SUB_FILTER: Schema = {"name": None}
ENVOY_FILTER_MATCH: Schema = {
    "context": None,
    "proxy": {"proxyVersion": None, "metadata": None},
    "listener": {"portNumber": None, "name": None, "listenerFilter": None, "filterChain": {
        "name": None, "sni": None, "transportProtocol": None, "applicationProtocols": None, "destinationPort": None,
        "filter": {"name": None, "subFilter": SUB_FILTER}}},
    "routeConfiguration": {"portNumber": None, "portName": None, "gateway": None, "name": None,
                           "vhost": {"name": None, "domainName": None, "route": {"name": None, "action": None}}},
    "cluster": {"portNumber": None, "service": None, "subset": None, "name": None},
}
SPECS: dict[str, Schema] = {
    "EnvoyFilter": {
        "workloadSelector": {"labels": None},
        "targetRefs": None,
        "priority": None,
        "configPatches": {"applyTo": None, "match": ENVOY_FILTER_MATCH,
                          "patch": {"operation": None, "value": None, "filterClass": None}},
    },
    "Gateway": {"selector": None, "servers": {"port": PORT, "bind": None, "hosts": None, "tls": None,
                                              "defaultEndpoint": None, "name": None}},
    "VirtualService": {"hosts": None, "gateways": None, "exportTo": None, "tls": None, "tcp": None, "http": {
        k: None for k in ("redirect", "directResponse", "delegate", "rewrite", "fault", "mirror", "mirrors",
                          "mirrorPercentage", "corsPolicy", "headers", "name", "timeout")
    } | {
        "match": {k: None for k in ("name", "uri", "scheme", "method", "authority", "headers", "port",
                                    "sourceLabels", "gateways", "queryParams", "ignoreUriCase", "withoutHeaders",
                                    "sourceNamespace", "statPrefix")},
        "route": {"destination": {"host": None, "subset": None, "port": {"number": None}}, "weight": None,
                  "headers": None},
        "retries": {"attempts": None, "perTryTimeout": None, "retryOn": None, "retryRemoteLocalities": None},
    }},
    "DestinationRule": {"host": None, "trafficPolicy": TRAFFIC_POLICY, "subsets": None, "exportTo": None,
                        "workloadSelector": None},
    "ServiceEntry": {"hosts": None, "addresses": None, "ports": PORT, "location": None, "resolution": None,
                     "workloadSelector": None, "exportTo": None, "subjectAltNames": None,
                     "endpoints": {k: None for k in ("address", "ports", "labels", "network", "locality", "weight",
                                                     "serviceAccount")}},
}
API_VERSIONS = {"EnvoyFilter": {"networking.istio.io/v1alpha3"},
                **{kind: {"networking.istio.io/v1alpha3", "networking.istio.io/v1beta1", "networking.istio.io/v1"}
                   for kind in ("Gateway", "VirtualService", "DestinationRule", "ServiceEntry")}}
ENUMS = {
    "applyTo": {"LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION", "VIRTUAL_HOST",
                "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER"},
    "context": {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"},
    "operation": {"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"},
    "simple": {"UNSPECIFIED", "LEAST_CONN", "RANDOM", "PASSTHROUGH", "ROUND_ROBIN", "LEAST_REQUEST"},
    "h2UpgradePolicy": {"DEFAULT", "DO_NOT_UPGRADE", "UPGRADE"},
    "mode": {"DISABLE", "SIMPLE", "MUTUAL", "ISTIO_MUTUAL"},
    "location": {"MESH_EXTERNAL", "MESH_INTERNAL"},
    "resolution": {"NONE", "STATIC", "DNS", "DNS_ROUND_ROBIN"},
    "protocol": {"HTTP", "HTTPS", "GRPC", "HTTP2", "MONGO", "TCP", "TLS"},
}


def resources() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(ISTIO.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def check_shape(value: Any, schema: Schema, where: str) -> list[str]:
    if isinstance(value, list):
        return [problem for i, item in enumerate(value) for problem in check_shape(item, schema, f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping"]
    problems = []
    for key, item in value.items():
        if key not in schema:
            problems.append(f"{where}.{key}: not a field here")
        elif key in ENUMS and isinstance(item, str) and item not in ENUMS[key]:
            problems.append(f"{where}.{key}: {item!r} is not one of {sorted(ENUMS[key])}")
        elif schema[key] is not None:
            problems.extend(check_shape(item, schema[key], f"{where}.{key}"))
    return problems


@pytest.mark.parametrize(("source", "resource"), resources(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_resource_shape(source: str, resource: dict[str, Any]) -> None:
    kind = resource["kind"]
    assert resource["apiVersion"] in API_VERSIONS[kind]
    assert set(resource) == {"apiVersion", "kind", "metadata", "spec"}
    assert resource["metadata"]["name"] and resource["metadata"]["namespace"]
    assert check_shape(resource["spec"], SPECS[kind], f"{source}:{kind}.spec") == []


PATCH_TYPES: dict[str, type[message.Message]] = {
    "NETWORK_FILTER": listener_components_pb2.Filter,
    "HTTP_FILTER": hcm_pb2.HttpFilter,
    "LISTENER": listener_pb2.Listener,
    "CLUSTER": cluster_pb2.Cluster,
    "HTTP_ROUTE": route_components_pb2.Route,
}


def envoy_filter() -> dict[str, Any]:
    [resource] = [r for _, r in resources() if r["kind"] == "EnvoyFilter"]
    return resource


def test_patch_values_are_envoy_messages() -> None:
    for patch in envoy_filter()["spec"]["configPatches"]:
        json_format.ParseDict(patch["patch"]["value"], PATCH_TYPES[patch["applyTo"]]())  # raises on any typo


def _services() -> dict[str, dict[str, Any]]:
    found = {}
    for path in (ROOT / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Service":
                found[f"{doc['metadata']['name']}.{doc['metadata']['namespace']}.svc.cluster.local"] = doc
    return found


def _service_port(host: str, number: int) -> dict[str, Any]:
    service = _services()[host]
    [port] = [p for p in service["spec"]["ports"] if p["port"] == number]
    return port  # type: ignore[no-any-return]


def test_names_agree_with_the_kubernetes_manifests() -> None:
    patches = {p["applyTo"]: p for p in envoy_filter()["spec"]["configPatches"]}
    cluster = patches["HTTP_FILTER"]["patch"]["value"]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    direction, port, _, host = cluster.split("|")
    assert direction == "outbound"
    assert _service_port(host, int(port))["name"].startswith("grpc")  # Istio speaks HTTP/2 to grpc ports
    by_kind = {r["kind"]: r for _, r in resources() if r["kind"] != "DestinationRule"}
    gateway_server = by_kind["Gateway"]["spec"]["servers"][0]
    vhost = patches["HTTP_ROUTE"]["match"]["routeConfiguration"]["vhost"]["name"]
    assert vhost == f"{gateway_server['hosts'][0]}:{gateway_server['port']['number']}"
    destination = by_kind["VirtualService"]["spec"]["http"][0]["route"][0]["destination"]
    _service_port(destination["host"], destination["port"]["number"])
    rules = [r for _, r in resources() if r["kind"] == "DestinationRule"]
    assert {r["spec"]["host"] for r in rules} <= set(_services())
    assert host in {r["spec"]["host"] for r in rules}
