"""TLS contexts of the TCP data plane: mutual TLS 1.3 with the pool's CA.

Both sides present a certificate signed by the pool's CA and verify the
other's against it. Host names are not checked (``check_hostname = False``):
peers are dialled by pod IP, and who a peer is, is proven by the pool-key
session HMAC that still runs inside the TLS connection. TLS adds secrecy and
integrity of the bytes in transit, and keeps out any client without a pool
certificate before it reaches the HMAC.

Every sidecar is both a server and a client, so its certificate must be usable for both
(extended key usages ``server auth`` and ``client auth``, or none). Loading checks that
with a handshake of the certificate against itself, in memory: a certificate the pool's
peers would refuse (another CA, expired, one usage missing) fails at startup instead of
at every connection. Loading errors are ``ValueError``s naming the file and what to change.

Renewal and CA rotation (``TlsContexts.reload``): a changed, valid set of files is loaded
into fresh contexts that replace the old ones, so a CA removed from the bundle is no
longer trusted (loading into a live context only ever adds). The rule for connections:
every TLS handshake after the reload, in either direction, uses the new set; a
connection already open keeps the peer its own handshake verified until it closes (TLS
checks a certificate once; the peer also holds a session of the pool key, and a peer
left on a removed CA fails its next handshake when that connection ends). Server
contexts issue no session tickets, so no peer resumes past a reload without showing
its certificate again.
"""

from __future__ import annotations

import ssl

# What a PEM certificate and a PEM private key start with.
_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKERS = (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----",
                b"-----BEGIN EC PRIVATE KEY-----")
_ENCRYPTED_KEY_MARKERS = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")


# What to change when a peer would refuse this certificate, by OpenSSL's verify message.
_REFUSAL_HINTS = (
    ("purpose", "it must allow both server auth and client auth (every sidecar is both); with "
                "cert-manager set usages: [digital signature, key encipherment, server auth, client auth]"),
    ("expired", "renew it"),
    ("not yet valid", "check the clocks, or wait until its notBefore"),
    ("issuer", "it is not signed by --tls-ca-file; give the CA that signed it, or a certificate of the pool CA"),
    ("self-signed", "it is not signed by --tls-ca-file; give the CA that signed it, or a certificate of the pool CA"),
)


def server_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """The data-plane server's context: requires a client certificate signed by ``ca_file``."""
    context = _context(True, cert_file, key_file, ca_file)
    _check_accepted(cert_file, key_file, ca_file)
    return context


def client_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """The data-plane client's context: presents ``cert_file``, verifies the server against ``ca_file``."""
    context = _context(False, cert_file, key_file, ca_file)
    _check_accepted(cert_file, key_file, ca_file)
    return context


def _context(server_side: bool, cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    if server_side:
        context.num_tickets = 0  # no resumption: every handshake shows a certificate to the live CA set
    else:
        context.check_hostname = False  # dialled by pod IP; the session HMAC proves the peer
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    _read_pem(ca_file, "--tls-ca-file", "the pool's CA certificate", (_CERT_MARKER,))
    _read_pem(cert_file, "--tls-cert-file", "this sidecar's certificate", (_CERT_MARKER,))
    _read_pem(key_file, "--tls-key-file", "the private key of --tls-cert-file", _KEY_MARKERS)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-ca-file {ca_file}: not a usable PEM CA certificate ({exc.reason or exc}); "
                         "give the CA that signs every pool member's certificate (ca.crt)") from None
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"--tls-key-file {key_file} does not match --tls-cert-file {cert_file}: "
                             "give the key the certificate was issued for (tls.key beside tls.crt)") from None
        raise ValueError(f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: cannot load the pair "
                         f"({exc.reason or exc}); give a PEM certificate and its unencrypted PEM key") from None
    return context


def memory_handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> bytes:
    """A TLS handshake between two contexts in memory; the server certificate the client saw (DER).

    Raises ``ssl.SSLError`` (``SSLCertVerificationError`` when a side refuses the other's
    certificate) or ``ssl.SSLError("... did not complete")``."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    sides = [client.wrap_bio(c_in, c_out, server_side=False), server.wrap_bio(s_in, s_out, server_side=True)]
    done = [False, False]
    for _ in range(8):  # TLS 1.3 needs three flights; the client's certificate is checked last
        for i, side in enumerate(sides):
            if not done[i]:
                try:
                    side.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done) and not c_out.pending and not s_out.pending:
            return sides[0].getpeercert(binary_form=True) or b""
    raise ssl.SSLError("TLS handshake did not complete")


def _check_accepted(cert_file: str, key_file: str, ca_file: str) -> None:
    """ValueError unless the certificate passes a handshake with itself (both roles), in memory."""
    server = _context(True, cert_file, key_file, ca_file)
    client = _context(False, cert_file, key_file, ca_file)
    try:
        memory_handshake(server, client)
    except ssl.SSLCertVerificationError as exc:
        message = exc.verify_message or str(exc)
        hint = next((h for word, h in _REFUSAL_HINTS if word in message), "give a certificate of the pool CA")
        raise ValueError(f"--tls-cert-file {cert_file} would be refused by the pool's peers "
                         f"({message}): {hint}") from None
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-cert-file {cert_file}: TLS with itself failed ({exc.reason or exc}); "
                         "give a certificate of the pool CA that allows server and client auth") from None


def _read_pem(path: str, flag: str, what: str, markers: tuple[bytes, ...]) -> None:
    """ValueError when the file is missing, unreadable or not the PEM expected."""
    if not path:
        raise ValueError(f"{flag} is empty: give the PEM file of {what}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file; mount the Secret holding {what} "
                         "there or fix the path") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read {what} ({exc.strerror}); "
                         "check the file and its permissions") from None
    if markers is _KEY_MARKERS and any(m in data for m in _ENCRYPTED_KEY_MARKERS):
        raise ValueError(f"{flag} {path}: the private key is encrypted with a passphrase; "
                         "give the unencrypted PEM key (as a kubernetes.io/tls Secret holds it)")
    if not any(m in data for m in markers):
        convert = "openssl pkey" if markers is _KEY_MARKERS else "openssl x509"
        raise ValueError(f"{flag} {path}: not {what} in PEM (no {markers[0].decode()} line); "
                         f"give the PEM file (a DER file converts with {convert} -inform der)")


def _no_passphrase() -> bytes:
    raise ValueError("encrypted private keys are not supported")


class TlsContexts:
    """The live server and client contexts of one sidecar, renewed from their files.

    cert-manager renews a certificate (or rotates the CA bundle) by rewriting the mounted
    Secret; ``reload()`` (called with the key files' reload) builds fresh contexts from a
    changed, valid set and swaps them in; a changed set that does not load (half written,
    wrong key) is skipped and the old contexts stay. ``client`` is the context a new outbound
    connection takes (read it at each connection). ``server`` is the one object the data
    server holds: it hands every incoming handshake to the current server context (its
    ``sni_callback``, which OpenSSL calls at every ClientHello, with or without a name).
    """

    def __init__(self, cert_file: str, key_file: str, ca_file: str) -> None:
        self.files = (cert_file, key_file, ca_file)
        self.server = server_context(*self.files)
        self.client = client_context(*self.files)
        # The server context of the files as last loaded (``server`` itself until a reload).
        self._current_server = self.server
        self.server.sni_callback = self._to_current
        self._stamp = self._read_stamp()

    def _to_current(self, connection: ssl.SSLObject, _name: str | None, _context: ssl.SSLContext) -> None:
        if self._current_server is not self.server:
            connection.context = self._current_server
        return None

    def _read_stamp(self) -> tuple[bytes, ...]:
        out = []
        for path in self.files:
            try:
                with open(path, "rb") as fh:
                    out.append(fh.read(1 << 20))
            except OSError:
                out.append(b"")
        return tuple(out)

    def reload(self) -> bool:
        """Swap in contexts built from changed files; True when they were renewed.

        Raises ValueError (naming the file) when the changed files do not load; the
        contexts in use then stay."""
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return False
        server, client = server_context(*self.files), client_context(*self.files)
        self._current_server, self.client = server, client
        self._stamp = stamp
        return True
