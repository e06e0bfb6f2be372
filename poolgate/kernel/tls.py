"""TLS from certificate files that rotate without a restart (the ``tls`` config section).

- ``ServerTls`` holds an ``ssl.SSLContext`` for an HTTP server (aiohttp), ``ClientTls`` one for a
  long-lived client (probes, scrapes); ``watch`` re-reads the files when they change, into the same
  context, so the next handshake uses them and open connections go on.
- ``grpc_server_credentials`` gives gRPC credentials whose files are looked at on every new handshake
  (gRPC asks for them then), so a rotated certificate is served from the next connection on.

A CA file that changes adds its certificates to those trusted (an SSL context cannot forget a CA): a CA
rotation adds the new CA first, then, once nothing uses the old one, restarts the server to drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from poolgate.kernel.config import ConfigError, TlsClientFiles, TlsServerFiles

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("poolgate.tls")


def file_signature(paths: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """What tells a rewritten file from the one loaded: modification time and size of each."""
    signature = []
    for path in paths:
        stat = os.stat(path)
        signature.append((stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


def check_files(files: TlsServerFiles, field: str) -> None:
    """ConfigError naming the field of each file that cannot be read (start-up fails fast)."""
    problems = [f"{field}.{name}: cannot read {path!r}" for name, path in
                (("cert_file", files.cert_file), ("key_file", files.key_file), ("client_ca_file", files.client_ca_file))
                if path is not None and not os.access(path, os.R_OK)]
    if problems:
        raise ConfigError("; ".join(problems))


def _paths(files: TlsServerFiles | TlsClientFiles) -> list[str]:
    names = ("cert_file", "key_file", "client_ca_file", "ca_file")
    return [path for path in (getattr(files, name, None) for name in names) if path is not None]


class WatchedTls:
    """An SSL context whose certificate files are loaded again, into the same context, when they change:
    connections made after the change use them, open ones go on with what they started with."""

    def __init__(self, context: ssl.SSLContext, paths: Sequence[str], load: Callable[[ssl.SSLContext], None],
                 field: str) -> None:
        self.context = context
        self._paths = list(paths)
        self._load = load
        self._field = field
        self._signature: tuple[tuple[int, int], ...] = ()
        self.loads = 0
        """How many times the files were loaded (1 at start, +1 per rotation seen)."""
        self.reload()

    def reload(self) -> bool:
        """Load the files if they changed since the last load; True when they did. A half-written file
        (a key that does not match the certificate) is logged and retried at the next look."""
        signature = file_signature(self._paths)
        if signature == self._signature:
            return False
        try:
            self._load(self.context)
        except (ssl.SSLError, OSError) as exc:
            if not self.loads:
                raise ConfigError(f"{self._field}: cannot load the certificate files: {exc}") from exc
            log.warning("%s: certificate files changed but do not load (%s); keeping the previous ones",
                        self._field, exc)
            return False
        self._signature = signature
        self.loads += 1
        if self.loads > 1:
            log.info("%s: certificate files reloaded", self._field)
        return True

    async def watch(self, interval_s: float, stop: asyncio.Event | None = None) -> None:
        """Look at the files every ``interval_s`` until ``stop`` (or cancelled)."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            with contextlib.suppress(OSError):  # a file being replaced: look again next time
                self.reload()


class ServerTls(WatchedTls):
    """A server-side SSL context (an HTTP server's) from ``files``, re-read in place when they change."""

    def __init__(self, files: TlsServerFiles, field: str) -> None:
        check_files(files, field)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if files.client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED

        def load(context: ssl.SSLContext) -> None:
            context.load_cert_chain(files.cert_file, files.key_file)
            if files.client_ca_file is not None:
                context.load_verify_locations(cafile=files.client_ca_file)

        super().__init__(context, _paths(files), load, field)


class ClientTls(WatchedTls):
    """A long-lived client's SSL context from ``files`` (as ``client_context``: the controller's probes, the
    agent's scrapes), its client certificate and CA re-read in place when they change."""

    def __init__(self, files: TlsClientFiles, field: str) -> None:
        try:
            context = client_context(files)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"{field}: cannot load the certificate files: {exc}") from exc
        assert context is not None

        def load(context: ssl.SSLContext) -> None:
            context.load_verify_locations(cafile=files.ca_file)
            if files.cert_file is not None and files.key_file is not None:
                context.load_cert_chain(files.cert_file, files.key_file)

        super().__init__(context, _paths(files), load, field)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def grpc_server_credentials(files: TlsServerFiles, field: str) -> grpc.ServerCredentials:
    """Credentials that serve the files' current content: gRPC asks at each new handshake, and the files
    are read again only when they changed."""
    import grpc  # here: the HTTP-only users of this module (CLI, agent, simulated worker) never load grpc

    check_files(files, field)
    state: dict[str, object] = {"signature": file_signature(_paths(files))}

    def configuration() -> grpc.ServerCertificateConfiguration:
        ca = _read(files.client_ca_file) if files.client_ca_file is not None else None
        return grpc.ssl_server_certificate_configuration([(_read(files.key_file), _read(files.cert_file))], ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            signature = file_signature(_paths(files))
            if signature == state["signature"]:
                return None
            fresh = configuration()
        except OSError as exc:
            log.warning("%s: certificate files unreadable (%s); keeping the previous ones", field, exc)
            return None
        state["signature"] = signature
        log.info("%s: certificate files reloaded", field)
        return fresh

    try:
        initial = configuration()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read the certificate files: {exc}") from exc
    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=files.client_ca_file is not None)


def bind_grpc(server: grpc.aio.Server, address: str, files: TlsServerFiles | None, field: str) -> int:
    """Bind ``address`` with TLS from ``files``, or in the clear when None; the bound port (0: failed)."""
    if files is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, grpc_server_credentials(files, field))




def worker_scheme(files: TlsClientFiles | None) -> str:
    """``https`` when the workers serve TLS (``tls.workers``), else ``http``."""
    return "https" if files is not None else "http"


def client_context(files: TlsClientFiles | None) -> ssl.SSLContext | None:
    """A client's TLS from ``files`` (the controller's and agents' towards workers, the operator commands'
    towards the registry API): the chain checked against ``ca_file``, the name against the address dialled
    unless ``server_name`` is set, the client certificate when ``cert_file`` is set. None: plain HTTP."""
    if files is None:
        return None
    context = ssl.create_default_context(cafile=files.ca_file)
    if files.server_name:
        context.check_hostname = False  # the name is not the address dialled; Envoy checks server_name
    if files.cert_file is not None and files.key_file is not None:
        context.load_cert_chain(files.cert_file, files.key_file)
    return context
