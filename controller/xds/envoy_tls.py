"""Envoy's TLS towards its upstreams, with certificates that rotate without a restart: file-based SDS.

Envoy reads a certificate file named inline in a TLS context once, when it loads the cluster. Through SDS
from a file (``sds_config.path_config_source``) it watches instead: the SDS file names the certificate
files, and Envoy watches the directory of each for a file renamed into it (the way a Kubernetes Secret
volume or an atomic ``mv`` replaces one), re-reads the files and uses them from the next connection on.
Open connections keep the certificate they started with.

One client side of Envoy (``tls.envoy`` towards the xDS and extproc servers, ``tls.workers`` towards the
workers) is two secrets: its certificate and key (when it has a client certificate) and the CA bundle it
checks servers with, each in its own SDS file under ``tls.envoy_sds_dir``. Those SDS files only name the
configured files, so they change only with the config; ``write_sds_files`` writes them (atomically) for
the Envoy on this machine. The name check (``server_name``) stays in the cluster, beside the CA from SDS.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from envoy.config.core.v3 import base_pb2, config_source_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import json_format

from poolgate.kernel.config import TlsClientFiles, TlsSettings

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


@dataclass(frozen=True)
class ClientSide:
    """One of Envoy's client sides: its configured files and where its SDS files live."""

    name: str
    """``envoy`` or ``workers``: the ``tls`` field it comes from, and part of its secrets' names."""
    files: TlsClientFiles
    sds_dir: str

    @property
    def certificate_secret(self) -> str:
        return f"poolgate-{self.name}-certificate"

    @property
    def ca_secret(self) -> str:
        return f"poolgate-{self.name}-ca"

    def sds_path(self, secret: str) -> str:
        return posixpath.join(self.sds_dir, f"{secret}.json")


def client_sides(tls: TlsSettings) -> tuple[ClientSide | None, ClientSide | None]:
    """(``tls.envoy``, ``tls.workers``) as client sides, None where unset."""
    def side(name: str, files: TlsClientFiles | None) -> ClientSide | None:
        if files is None:
            return None
        assert tls.envoy_sds_dir is not None  # the config requires it with either section
        return ClientSide(name, files, tls.envoy_sds_dir)

    return side("envoy", tls.envoy), side("workers", tls.workers)


def _from_file(side: ClientSide, secret: str) -> secret_pb2.SdsSecretConfig:
    source = config_source_pb2.ConfigSource(resource_api_version=config_source_pb2.V3)
    source.path_config_source.path = side.sds_path(secret)
    return secret_pb2.SdsSecretConfig(name=secret, sds_config=source)


def upstream_tls(side: ClientSide, alpn: Sequence[str] = ()) -> base_pb2.TransportSocket:
    """Envoy's TLS towards an upstream: the server's chain checked against the side's CA bundle (and its
    name against ``server_name``, also sent as SNI, when set), its client certificate when it has one; both
    through SDS from files. gRPC upstreams need ``alpn`` ``h2`` (a gRPC server refuses a TLS client that
    offers no ALPN)."""
    context = tls_pb2.UpstreamTlsContext(sni=side.files.server_name)
    common = context.common_tls_context
    common.alpn_protocols.extend(alpn)
    validation = common.combined_validation_context
    validation.validation_context_sds_secret_config.CopyFrom(_from_file(side, side.ca_secret))
    validation.default_validation_context.SetInParent()
    if side.files.server_name:
        validation.default_validation_context.match_typed_subject_alt_names.add(
            san_type=tls_common_pb2.SubjectAltNameMatcher.DNS,
            matcher=string_pb2.StringMatcher(exact=side.files.server_name))
    if side.files.cert_file is not None:
        common.tls_certificate_sds_secret_configs.append(_from_file(side, side.certificate_secret))
    socket = base_pb2.TransportSocket(name="envoy.transport_sockets.tls")
    socket.typed_config.Pack(context)
    return socket


def sds_documents(side: ClientSide) -> dict[str, str]:
    """SDS file path → its JSON text (a DiscoveryResponse holding one secret that names the files)."""
    secrets = [secret_pb2.Secret(name=side.ca_secret, validation_context=tls_common_pb2.CertificateValidationContext(
        trusted_ca=base_pb2.DataSource(filename=side.files.ca_file)))]
    if side.files.cert_file is not None and side.files.key_file is not None:
        secrets.append(secret_pb2.Secret(name=side.certificate_secret, tls_certificate=tls_common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(filename=side.files.cert_file),
            private_key=base_pb2.DataSource(filename=side.files.key_file))))
    documents = {}
    for secret in secrets:
        resource = json_format.MessageToDict(secret, preserving_proto_field_name=True)
        document = {"resources": [{"@type": SECRET_TYPE_URL, **resource}]}
        documents[side.sds_path(secret.name)] = json.dumps(document, indent=2, sort_keys=True) + "\n"
    return documents


def write_sds_files(tls: TlsSettings) -> list[Path]:
    """Write the SDS files of ``tls.envoy`` and ``tls.workers`` into ``tls.envoy_sds_dir`` (created owner-only
    when missing: whoever may write there chooses which CA Envoy trusts); the paths written. Each is
    written beside its place and renamed over it, so a running Envoy reloads it whole."""
    written = []
    for side in client_sides(tls):
        if side is None:
            continue
        for path, text in sds_documents(side).items():
            target = Path(path)
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            staging = target.with_name(f".{target.name}.new")
            staging.write_text(text)
            os.replace(staging, target)
            written.append(target)
    return written
