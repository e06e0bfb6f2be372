"""Transport security outside a mesh: TLS from certificate files for the controller's registry API, its xDS
server, extproc's gRPC port and Envoy's connections to those and to the workers.

Every file is re-read when it changes (looked at every ``reload_s``), so certificates rotate without a
restart. A server section with ``client_ca_file`` requires clients to present a certificate signed by that
CA (mutual TLS); without it any client may connect over TLS. The files are checked when a process that uses
them starts (they may live only on the machines that need them), not by ``poolgate config check``.
"""

from __future__ import annotations

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
