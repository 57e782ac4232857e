"""The webhook's HTTPS server: kopf's, with a certificate that follows tls.crt/tls.key on disk.

``webhook_server`` serves the pair in ``--webhook-cert-dir`` (e.g. a
cert-manager Secret) or, without one, a self-signed development certificate.
``CertFollowingWebhookServer`` re-reads the pair every
``--webhook-cert-check-seconds`` and loads a changed, matching pair into the
live SSL context: no restart, and a half-written pair is skipped.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import logging
import os
import re
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf

# kopf's own file check would restart the listener (and fail on a half-written pair); never let it.
_KOPF_FILE_CHECK_SECONDS = 365 * 24 * 3600.0


def webhook_server(*, addr: str, port: int, host: str | None, cert_dir: str | None,
                   check_seconds: float, logger: logging.Logger) -> tuple[kopf.WebhookServer, Path | None]:
    """The server, and the directory of a self-signed dev pair (delete it at shutdown) or None.

    kopf.PermanentError when ``cert_dir`` lacks tls.crt or tls.key.
    """
    self_signed_dir = None
    if cert_dir:
        certfile, keyfile = Path(cert_dir) / "tls.crt", Path(cert_dir) / "tls.key"
        for f in (certfile, keyfile):
            if not f.is_file():
                raise kopf.PermanentError(f"--webhook-cert-dir {cert_dir}: {f.name} is missing")
    else:
        logger.warning("No --webhook-cert-dir: serving the webhook with a self-signed certificate (dev only).")
        certfile, keyfile = self_signed_certificate(host=host, addr=addr)
        self_signed_dir = certfile.parent
    server = CertFollowingWebhookServer(addr=addr, port=port, host=host, certfile=str(certfile),
                                        pkeyfile=str(keyfile), check_seconds=check_seconds)
    return server, self_signed_dir


class CertFollowingWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server whose certificate follows tls.crt/tls.key on disk.

    cert-manager and the kubelet renew the mounted Secret in place. Every
    ``check_seconds`` the pair is re-read; a changed pair is first loaded into
    a scratch SSL context (so a half-written pair, whose key does not match its
    certificate, is skipped until it is whole) and then into the live context:
    new connections get the new certificate, the listener never restarts.
    """

    def __init__(self, *, certfile: str, pkeyfile: str, check_seconds: float, **kwargs: Any) -> None:
        if not check_seconds > 0:
            raise ValueError(f"check_seconds={check_seconds!r} must be positive")
        super().__init__(certfile=certfile, pkeyfile=pkeyfile,
                         context=ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH),
                         file_check_interval=_KOPF_FILE_CHECK_SECONDS, **kwargs)
        self.check_seconds = check_seconds

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        serving = asyncio.current_task()
        follower = asyncio.create_task(self._follow_cert_files(), name="webhook-cert-follower")

        def stop_serving_if_failed(task: asyncio.Task[None]) -> None:
            if serving is not None and not task.cancelled() and task.exception() is not None:
                serving.cancel()  # below, the cancellation becomes the follower's error

        follower.add_done_callback(stop_serving_if_failed)
        try:
            async for client_config in super().__call__(fn):
                yield client_config
        except asyncio.CancelledError:
            failure = follower.exception() if follower.done() and not follower.cancelled() else None
            if failure is None:
                raise
            # The live context may hold a half-loaded pair: stop the operator (exit 1, restarted).
            raise RuntimeError(f"the webhook certificate could not be loaded into the live TLS context "
                               f"({failure}); exiting so that the operator is restarted") from failure
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    def _read_pair(self) -> tuple[bytes, bytes]:
        with open(str(self.certfile), "rb") as cert, open(str(self.pkeyfile), "rb") as key:
            return cert.read(), key.read()

    async def _follow_cert_files(self) -> None:
        logger = logging.getLogger("kv_offload_operator.webhook")
        loaded: tuple[bytes, bytes] | None = None  # None: reload once, whatever kopf read at start
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                pair = self._read_pair()
                if pair == loaded:
                    continue
                _load_pem_pair(ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH), *pair)
            except (OSError, ssl.SSLError, ValueError) as exc:
                logger.warning(f"Webhook certificate {self.certfile} not (re)loaded yet: {exc}; retrying.")
                continue
            assert self.context is not None
            _load_pem_pair(self.context, *pair)
            loaded = pair
            logger.info(f"Webhook certificate loaded from {self.certfile}: sha256:{_cert_sha256(pair[0])}.")


def _cert_sha256(pem: bytes) -> str:
    """SHA-256 of the first certificate's DER (as `openssl x509 -fingerprint -sha256`)."""
    found = re.search(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", pem, re.S)
    return hashlib.sha256(base64.b64decode(found.group(1))).hexdigest() if found else "unknown"


def _load_pem_pair(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Load PEM bytes into ``context`` through memory files: exactly the bytes
    that were checked, and the key never touches a (read-only) disk."""
    fds = [os.memfd_create("kv-offload-webhook-tls", os.MFD_CLOEXEC) for _ in range(2)]
    try:
        for fd, data in zip(fds, (cert, key)):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)


def self_signed_certificate(*, host: str | None, addr: str) -> tuple[Path, Path]:
    """A throw-away certificate for development clusters, valid for ``host``, ``addr`` and
    localhost; (tls.crt, tls.key) in a new temporary directory."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    names = [n for n in (host, addr, "localhost") if n]
    sans: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            ip = ipaddress.ip_address(n)
        except ValueError:
            sans.append(x509.DNSName(n))
        else:
            if not ip.is_unspecified:
                sans.append(x509.IPAddress(ip))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host or "kv-offload-webhook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    out = Path(tempfile.mkdtemp(prefix="kv-offload-webhook-"))
    (out / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                     serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return out / "tls.crt", out / "tls.key"
