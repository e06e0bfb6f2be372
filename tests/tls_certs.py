"""Certificates a test makes for itself with ``cryptography``: CAs, server and client certificates as PEM
files, and an atomic rewrite (rename into place) the way a secret rotation lands."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


def make_ca(name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_validity(x509.CertificateBuilder())
            .subject_name(_name(name)).issuer_name(_name(name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return Authority(name, key, cert)


def issue(ca: Authority, common_name: str, *, server: bool) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by ``ca``; a server certificate names localhost and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (_validity(x509.CertificateBuilder())
               .subject_name(_name(common_name)).issuer_name(ca.cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_atomically(path: Path, data: bytes) -> None:
    """Write beside ``path`` and rename over it: readers see the old file or the new one, never half."""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


@dataclass(frozen=True)
class TlsFiles:
    """One directory of PEM files: the CA, a server pair and a client pair."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server-key.pem"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client-key.pem"

    def write_server(self, ca: Authority) -> None:
        """A new server pair signed by ``ca`` (key first: a reader that catches the cert alone sees a
        mismatch and keeps the previous pair, then loads both at its next look)."""
        cert, key = issue(ca, "poolgate-server", server=True)
        write_atomically(self.server_key, key)
        write_atomically(self.server_cert, cert)

    def write_client(self, ca: Authority) -> None:
        """A new client pair signed by ``ca`` (key first, as ``write_server``)."""
        cert, key = issue(ca, "poolgate-client", server=False)
        write_atomically(self.client_key, key)
        write_atomically(self.client_cert, cert)

    def write_ca(self, ca: Authority) -> None:
        """``ca`` alone as the CA bundle (the previous CA is no longer trusted by whoever reads it afresh)."""
        write_atomically(self.ca, ca.pem())


def make_tls_files(directory: Path, ca: Authority | None = None) -> tuple[TlsFiles, Authority]:
    """A CA (``ca``, or a new one), a server certificate for localhost/127.0.0.1 and a client certificate,
    all in ``directory``."""
    ca = ca or make_ca("poolgate-test-ca")
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory)
    files.write_ca(ca)
    files.write_server(ca)
    files.write_client(ca)
    return files, ca
