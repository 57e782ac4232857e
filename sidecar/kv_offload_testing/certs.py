"""Throw-away TLS material for tests and benches: a pool CA and certificates it signs.

``pool_certificates(directory, ["a", "b"])`` writes ``ca.crt`` and, per name,
``<name>.crt`` / ``<name>.key`` (what a cert-manager ``Certificate`` of the pool's
issuer puts in a kubernetes.io/tls Secret), and returns the file paths the sidecar's
``--tls-cert-file``, ``--tls-key-file`` and ``--tls-ca-file`` take. Each call makes
a new CA, so two calls give two pools whose certificates do not trust each other.
Certificates allow ``server auth`` and ``client auth`` (a sidecar is both) unless
``usages`` says otherwise.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CertFiles:
    """One sidecar's TLS files."""

    # PEM certificate signed by the pool CA.
    cert_file: str
    # PEM private key of cert_file (PKCS#8, unencrypted).
    key_file: str
    # PEM certificate of the pool CA.
    ca_file: str


# Extended key usages by the names cert-manager's Certificate.spec.usages gives them.
USAGES = {"server auth": "SERVER_AUTH", "client auth": "CLIENT_AUTH"}


def pool_certificates(directory: str | Path, names: Sequence[str], *, days: int = 7,
                      usages: Sequence[str] = ("server auth", "client auth")) -> dict[str, CertFiles]:
    """A new CA in ``directory`` and one certificate per name signed by it, valid ``days`` days,
    with the extended key ``usages`` (keys of ``USAGES``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"kv-offload pool CA {out_dir.name}")
    ca = (_builder(ca_name, ca_name, ca_key.public_key(), days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True))
    ca_cert = _sign(ca, ca_key)
    ca_file = out_dir / "ca.crt"
    ca_file.write_bytes(_pem_cert(ca_cert))
    files = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = (_builder(_name(name), ca_cert.subject, key.public_key(), days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage(
                    [getattr(x509.oid.ExtendedKeyUsageOID, USAGES[u]) for u in usages]), critical=False))
        cert_file, key_file = out_dir / f"{name}.crt", out_dir / f"{name}.key"
        cert_file.write_bytes(_pem_cert(_sign(leaf, ca_key)))
        key_file.write_bytes(_pem_key(key))
        key_file.chmod(0o600)
        files[name] = CertFiles(str(cert_file), str(key_file), str(ca_file))
    return files


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: Any, issuer: Any, public_key: Any, days: int) -> Any:
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _sign(builder: Any, key: Any) -> Any:
    from cryptography.hazmat.primitives import hashes

    return builder.sign(key, hashes.SHA256())


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
