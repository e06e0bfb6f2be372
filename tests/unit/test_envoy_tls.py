"""Envoy's TLS contexts read their certificate files through file-based SDS (so they rotate without a
restart): the bootstrap's xDS and extproc clusters and the pool clusters name SDS files, and those files
name the configured certificate files; the local backend starts workers with vLLM's HTTPS flags."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from controller.local_backend import tls_launch, worker_command
from controller.xds.bootstrap import EXTPROC_CLUSTER, XDS_CLUSTER, render_bootstrap
from controller.xds.build import build_clusters
from controller.xds.envoy_tls import SECRET_TYPE_URL, write_sds_files
from poolgate.cli import main as cli_main
from poolgate.kernel.config import Config, TlsServerFiles, parse_config
from poolgate.kernel.routing import FALLBACK_CLUSTER


def tls_config(tmp_path: Path, **extra: Any) -> Config:
    server = {"cert_file": "/tls/server.pem", "key_file": "/tls/server-key.pem", "client_ca_file": "/tls/ca.pem"}
    return parse_config({
        "pools": [{"name": "chat", "model": "m1"}],
        "tls": {"xds": server, "extproc": server,
                "envoy": {"ca_file": "/tls/ca.pem", "cert_file": "/tls/envoy.pem", "key_file": "/tls/envoy-key.pem"},
                "workers": {"ca_file": "/tls/workers-ca.pem", "server_name": "workers.internal"},
                "envoy_sds_dir": str(tmp_path / "sds"), **extra},
    })


def upstream_context(cluster: cluster_pb2.Cluster) -> tls_pb2.UpstreamTlsContext:
    context = tls_pb2.UpstreamTlsContext()
    assert cluster.transport_socket.typed_config.Unpack(context)
    return context


def sds_paths(context: tls_pb2.UpstreamTlsContext) -> tuple[str, list[str]]:
    """(the CA's SDS file, the client certificates' SDS files)"""
    common = context.common_tls_context
    assert not common.tls_certificates and not common.HasField("validation_context")  # nothing inline
    ca = common.combined_validation_context.validation_context_sds_secret_config.sds_config.path_config_source.path
    return ca, [c.sds_config.path_config_source.path for c in common.tls_certificate_sds_secret_configs]


def test_bootstrap_clusters_read_envoys_files_through_sds(tmp_path: Path) -> None:
    config = tls_config(tmp_path)
    rendered = render_bootstrap(config, node_id="n", listen_port=1, admin_port=2, extproc_port=3, xds_port=4)
    bootstrap = json_format.ParseDict(yaml.safe_load(yaml.safe_dump(rendered)), bootstrap_pb2.Bootstrap())
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    sds = tmp_path / "sds"
    for name in (XDS_CLUSTER, EXTPROC_CLUSTER):
        context = upstream_context(clusters[name])
        assert list(context.common_tls_context.alpn_protocols) == ["h2"]
        assert sds_paths(context) == (str(sds / "poolgate-envoy-ca.json"),
                                      [str(sds / "poolgate-envoy-certificate.json")])


def test_pool_clusters_read_the_workers_files_through_sds_and_keep_the_name_check(tmp_path: Path) -> None:
    clusters = build_clusters(tls_config(tmp_path).pools, tls_config(tmp_path).tls)
    assert {c.name for c in clusters} == {"pool-chat", FALLBACK_CLUSTER}
    for cluster in clusters:
        context = upstream_context(cluster)
        assert context.sni == "workers.internal"
        assert sds_paths(context) == (str(tmp_path / "sds" / "poolgate-workers-ca.json"), [])  # no client cert
        names = context.common_tls_context.combined_validation_context.default_validation_context
        assert [m.matcher.exact for m in names.match_typed_subject_alt_names] == ["workers.internal"]


def test_sds_files_name_the_configured_files_and_are_written_owner_only(tmp_path: Path) -> None:
    written = write_sds_files(tls_config(tmp_path).tls)
    sds = tmp_path / "sds"
    assert sorted(p.name for p in written) == ["poolgate-envoy-ca.json", "poolgate-envoy-certificate.json",
                                               "poolgate-workers-ca.json"]
    assert stat.S_IMODE(sds.stat().st_mode) == 0o700
    assert not [p for p in sds.iterdir() if p.name.startswith(".")]  # no staging file left
    named = {}
    for path in written:
        response = json_format.ParseDict(json.loads(path.read_text()), discovery_pb2.DiscoveryResponse())
        [resource] = response.resources
        assert resource.type_url == SECRET_TYPE_URL
        document = json.loads(path.read_text())["resources"][0]
        named[document["name"]] = {k: v for k, v in document.items() if k not in ("name", "@type")}
    assert named == {
        "poolgate-envoy-ca": {"validation_context": {"trusted_ca": {"filename": "/tls/ca.pem"}}},
        "poolgate-envoy-certificate": {"tls_certificate": {"certificate_chain": {"filename": "/tls/envoy.pem"},
                                                           "private_key": {"filename": "/tls/envoy-key.pem"}}},
        "poolgate-workers-ca": {"validation_context": {"trusted_ca": {"filename": "/tls/workers-ca.pem"}}},
    }
    assert write_sds_files(parse_config({"pools": [{"name": "chat", "model": "m1"}]}).tls) == []


def test_local_workers_start_with_vllms_https_flags(tmp_path: Path) -> None:
    files = TlsServerFiles(cert_file="/tls/w.pem", key_file="/tls/w-key.pem", client_ca_file="/tls/ca.pem")
    assert tls_launch(files, "vllm", ()) == ["--ssl-certfile", "/tls/w.pem", "--ssl-keyfile", "/tls/w-key.pem",
                                             "--enable-ssl-refresh", "--ssl-ca-certs", "/tls/ca.pem",
                                             "--ssl-cert-reqs", "2"]
    assert tls_launch(files, "sim", ()) == ["--ssl-certfile", "/tls/w.pem", "--ssl-keyfile", "/tls/w-key.pem",
                                            "--ssl-ca-certs", "/tls/ca.pem"]  # the simulator requires one then
    assert tls_launch(files, "vllm", ("--ssl-certfile=/own.pem",)) == []  # the worker's own wins
    assert tls_launch(None, "vllm", ()) == []

    config = tls_config(tmp_path, local_workers={"cert_file": "/tls/w.pem", "key_file": "/tls/w-key.pem"})
    config = config.model_copy(update={"workers": parse_config({
        "pools": [{"name": "chat", "model": "m1"}], "workers": [{"id": "w1", "pool": "chat"}]}).workers})
    command, _ = worker_command(config, config.workers[0], 8001)
    assert command[command.index("--ssl-certfile") + 1] == "/tls/w.pem" and "--ssl-ca-certs" not in command


def test_envoy_sds_command_writes_the_files_for_an_envoy_started_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "poolgate.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "chat", "model": "m1"}], "tls": {
        "workers": {"ca_file": "/tls/ca.pem"}, "envoy_sds_dir": str(tmp_path / "sds")}}))
    assert cli_main(["envoy-sds", "--config", str(config)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "sds" / "poolgate-workers-ca.json")]
    config.write_text(yaml.safe_dump({"pools": [{"name": "chat", "model": "m1"}],
                                      "tls": {"workers": {"ca_file": "/tls/ca.pem"}}}))
    assert cli_main(["envoy-sds", "--config", str(config)]) == 2
    assert "envoy_sds_dir" in capsys.readouterr().err
