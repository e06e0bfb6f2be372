"""Transport security outside a mesh: TLS from certificate files for the controller's registry API, its xDS
server, extproc's gRPC port and Envoy's connections to those and to the workers.

Every file is re-read when it changes, so certificates rotate without a restart: poolgate's servers look
at theirs every ``reload_s``; Envoy reads its own (``envoy``, ``workers``) through file-based SDS, from
small SDS files in ``envoy_sds_dir`` that name them, and reloads them when one is renamed into place. A
server section with ``client_ca_file`` requires clients to present a certificate signed by that CA (mutual
TLS); without it any client may connect over TLS. The files are checked when a process that uses them
starts (they may live only on the machines that need them), not by ``poolgate config check``.
"""

from __future__ import annotations

import posixpath

from pydantic import Field, model_validator

from poolgate.kernel.config.base import Section


class TlsServerFiles(Section):
    """One server's certificate and key (PEM); ``client_ca_file`` turns on client certificates."""

    cert_file: str = Field(min_length=1)
    """The server's certificate chain (PEM), leaf first."""
    key_file: str = Field(min_length=1)
    """The server's private key (PEM, unencrypted)."""
    client_ca_file: str | None = Field(None, min_length=1)
    """CA bundle (PEM) that client certificates must chain to; set, a client without one is refused."""


class TlsClientFiles(Section):
    """How a client checks a TLS server, and its own certificate when the server asks for one."""

    ca_file: str = Field(min_length=1)
    """CA bundle (PEM) the server's certificate must chain to."""
    cert_file: str | None = Field(None, min_length=1)
    """The client's certificate chain (PEM), for servers that require client certificates."""
    key_file: str | None = Field(None, min_length=1)
    """The client's private key (PEM, unencrypted)."""
    server_name: str = ""
    """The name the server's certificate must carry (SNI and subject alternative name check); empty: the
    address connected to (for workers: the worker's host)."""

    @model_validator(mode="after")
    def _pair(self) -> TlsClientFiles:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both for a client certificate, or neither")
        return self


class TlsSettings(Section):
    """TLS between poolgate's parts. Each server section is off when unset; ``envoy`` is the certificate
    Envoy presents to the xDS and extproc servers (and the CA it checks them with), ``workers`` how Envoy
    and the controller's probes connect to workers over HTTPS."""

    reload_s: float = Field(5.0, gt=0, le=300)
    """How often the certificate files are looked at; a changed file is loaded for the next handshake."""
    registry_api: TlsServerFiles | None = None
    """The controller's HTTP registry API (HTTPS)."""
    xds: TlsServerFiles | None = None
    """The controller's xDS gRPC server."""
    extproc: TlsServerFiles | None = None
    """extproc's gRPC port (Envoy's ext_proc cluster then speaks TLS)."""
    envoy: TlsClientFiles | None = None
    """Envoy's side of its connections to the xDS and extproc servers; required when either is TLS."""
    workers: TlsClientFiles | None = None
    """Envoy's upstream connections to workers (the pool clusters), and the controller's probes and the
    agent's scrapes; workers then serve HTTPS."""
    operator: TlsClientFiles | None = None
    """The operator commands' (``poolgate drain``, ``poolgate scale``) side towards an HTTPS registry API."""
    local_workers: TlsServerFiles | None = None
    """The certificate the local backend starts its workers with (``vllm serve --ssl-certfile --ssl-keyfile
    --enable-ssl-refresh``; with ``client_ca_file`` also ``--ssl-ca-certs`` and ``--ssl-cert-reqs 2``, so a
    worker refuses clients without a certificate from that CA). Needs ``workers``: how the clients check
    them."""
    envoy_sds_dir: str | None = None
    """Absolute directory on Envoy's machine for the SDS files through which Envoy reads the ``envoy`` and
    ``workers`` certificate files (every Envoy of the deployment uses the same one: the controller names it
    in the pool clusters it sends). ``poolgate up`` writes them; ``poolgate envoy-sds`` writes them for an
    Envoy started otherwise. Required when ``envoy`` or ``workers`` is set."""

    @model_validator(mode="after")
    def _envoy_side(self) -> TlsSettings:
        if (self.xds is not None or self.extproc is not None) and self.envoy is None:
            raise ValueError("envoy: xds or extproc serve TLS, so Envoy needs tls.envoy (at least ca_file) "
                             "to connect to them")
        for name in ("xds", "extproc"):
            server = getattr(self, name)
            if server is not None and server.client_ca_file and self.envoy is not None and not self.envoy.cert_file:
                raise ValueError(f"envoy: {name} requires client certificates (client_ca_file), so tls.envoy "
                                 "needs cert_file and key_file")
        return self

    @model_validator(mode="after")
    def _envoy_sds(self) -> TlsSettings:
        if (self.envoy is not None or self.workers is not None) and not self.envoy_sds_dir:
            raise ValueError("envoy_sds_dir: Envoy reads its certificate files (tls.envoy, tls.workers) through "
                             "SDS files so that they rotate without a restart; set an absolute directory on "
                             "Envoy's machine for them (poolgate up writes them there)")
        if self.envoy_sds_dir and not posixpath.isabs(self.envoy_sds_dir):
            raise ValueError(f"envoy_sds_dir: {self.envoy_sds_dir!r} is relative; Envoy resolves it against its "
                             "own working directory, so give an absolute path")
        return self

    @model_validator(mode="after")
    def _local_workers(self) -> TlsSettings:
        if self.local_workers is not None and self.workers is None:
            raise ValueError("local_workers: the local backend's workers serve HTTPS, so tls.workers (the CA that "
                             "Envoy and the probes check them with) is needed too")
        if (self.local_workers is not None and self.local_workers.client_ca_file
                and self.workers is not None and not self.workers.cert_file):
            raise ValueError("local_workers: the workers require client certificates (client_ca_file), so "
                             "tls.workers needs cert_file and key_file")
        return self
