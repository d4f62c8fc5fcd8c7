"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and a
client certificate, all generated in the test run (nothing secret is committed)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool, san: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(d: Path) -> dict[str, bytes | Path]:
    """PEM bytes (`ca`, `server_cert`, ...) and their files (`ca_path`, ...) under `d`."""
    ca_key = _key()
    ca = _cert("test-ca", ca_key, "test-ca", ca_key, ca=True, san=False)
    server_key, client_key = _key(), _key()
    server = _cert("feeder", server_key, "test-ca", ca_key, ca=False, san=True)
    client = _cert("trainer", client_key, "test-ca", ca_key, ca=False, san=False)
    files = {
        "ca": _pem(ca),
        "server_cert": _pem(server),
        "server_key": _pem(server_key),
        "client_cert": _pem(client),
        "client_key": _pem(client_key),
    }
    out: dict[str, bytes | Path] = {}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
        out[name] = data
        out[name + "_path"] = d / f"{name}.pem"
    return out


def server_tls(pki: dict, client_certificates: bool = False) -> dict[str, object]:
    """A feeder's TLS settings (ServerConfig keywords) for `make_pki`'s server
    certificate; with `client_certificates`, a client must show one its CA signed."""
    tls = {"tls_cert": pki["server_cert_path"], "tls_key": pki["server_key_path"]}
    return tls | ({"tls_client_ca": pki["ca_path"]} if client_certificates else {})
