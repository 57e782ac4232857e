"""The webhook's self-managed serving certificate: made once in the cluster, never by the template.

``new_pair`` makes a CA and a serving certificate signed by it (ECDSA P-256,
server auth, the webhook Service's DNS names); ``pair_problem`` says why a
Secret's ``ca.crt``/``tls.crt``/``tls.key`` cannot serve (missing, not
signed by its CA, another key, a DNS name missing, expiring), or None.
``cli.webhook_cert`` runs them in the chart's hook Jobs, so ``helm template``
renders no key material and every render is byte-identical.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Mapping, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Keys of the webhook's TLS Secret (type kubernetes.io/tls plus the CA the caBundle carries).
CA_KEY, CERT_KEY, PRIVATE_KEY_KEY = "ca.crt", "tls.crt", "tls.key"
SECRET_KEYS = (CA_KEY, CERT_KEY, PRIVATE_KEY_KEY)
# A certificate closer than this to its end is replaced on the next install or upgrade.
RENEW_BEFORE = datetime.timedelta(days=30)


def new_pair(common_name: str, dns_names: Sequence[str], validity_days: int,
             now: datetime.datetime | None = None) -> dict[str, bytes]:
    """{ca.crt, tls.crt, tls.key} as PEM: a fresh CA and a serving certificate for ``dns_names``."""
    if validity_days < 1:
        raise ValueError(f"validity_days={validity_days} must be at least 1")
    if not dns_names:
        raise ValueError("give at least one DNS name for the serving certificate")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=validity_days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name}-ca"[:64])])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0][:64])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return {
        CA_KEY: ca.public_bytes(serialization.Encoding.PEM),
        CERT_KEY: cert.public_bytes(serialization.Encoding.PEM),
        PRIVATE_KEY_KEY: key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()),
    }


def decode_secret_data(data: Mapping[str, str] | None) -> dict[str, bytes]:
    """A Secret's ``data`` (base64 values) as bytes; a value that is not base64 is left out."""
    decoded = {}
    for key, value in (data or {}).items():
        try:
            decoded[key] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError, TypeError):
            continue
    return decoded


def pair_problem(pair: Mapping[str, bytes], dns_names: Sequence[str],
                 now: datetime.datetime | None = None) -> str | None:
    """Why ``pair`` (``ca.crt``, ``tls.crt``, ``tls.key`` as PEM) cannot serve the webhook, or None."""
    missing = [k for k in SECRET_KEYS if not pair.get(k)]
    if missing:
        return f"it has no {', '.join(missing)}"
    try:
        ca = x509.load_pem_x509_certificate(pair[CA_KEY])
        cert = x509.load_pem_x509_certificate(pair[CERT_KEY])
        key = serialization.load_pem_private_key(pair[PRIVATE_KEY_KEY], password=None)
    except ValueError as exc:
        return f"its PEM does not load ({exc})"
    own = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    served = cert.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    if own != served:
        return "tls.key is not the key of tls.crt"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "tls.crt is not signed by ca.crt"
    try:
        names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                    .value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = set()
    absent = [n for n in dns_names if n not in names]
    if absent:
        return f"tls.crt does not name {', '.join(absent)}"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ends = min(cert.not_valid_after_utc, ca.not_valid_after_utc)
    if ends - now < RENEW_BEFORE:
        return f"it expires at {ends.isoformat()}, within {RENEW_BEFORE.days} days"
    return None
