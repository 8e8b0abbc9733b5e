"""TLS material for tests that serve HTTPS on 127.0.0.1: a self-signed certificate made on
the spot with ``cryptography``, which a client trusts as an operator trusts a private CA
(``AWS_CA_BUNDLE`` pointing at its PEM file)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["Certificate", "make_certificate"]


@dataclass(frozen=True, kw_only=True)
class Certificate:
    """A certificate's PEM file and its private key's PEM file."""

    cert_file: Path
    key_file: Path

    def server_context(self) -> ssl.SSLContext:
        """A server-side context that presents this certificate."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def make_certificate(folder: Path, name: str) -> Certificate:
    """A self-signed certificate for 127.0.0.1 (IP SAN), valid for a day, written to
    ``folder`` as ``{name}.pem`` and ``{name}.key``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    certificate = Certificate(cert_file=folder / f"{name}.pem", key_file=folder / f"{name}.key")
    certificate.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    certificate.key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certificate
