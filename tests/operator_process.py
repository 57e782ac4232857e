"""``kv-offload operator`` as a process of its own, the way every test that runs the operator starts it.

``OperatorProcess`` writes a kubeconfig for the emulated API server (kmock), picks free
ports, runs the installed console script (exactly what a container runs) with its log in
the work folder, and stops it with a signal; with ``webhook_tls`` it first makes a test
CA and the webhook's certificate. The operator tests (``tests/operator``) and the chart's
install test (``tests/chart``) import it from here.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kv_offload_testing.local_pool import free_port_block

# The namespace of the emulated cluster's objects, which the operator watches by default.
NAMESPACE = "ns1"
SIDECAR_IMAGE = "registry.example/kv-offload:test"
# The installed console script, exactly what a container runs.
KV_OFFLOAD = str(Path(sys.executable).with_name("kv-offload"))


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on every address just now, below Linux's ephemeral range
    (``free_port_block``): a port picked by binding port 0 comes from that range, where another
    process's outgoing connection can take it before the operator binds it (its health server
    once died on "address already in use" while other tests ran beside it). The operator binds
    its health port on 0.0.0.0, so each is checked there."""
    return [free_port_block(1, host="0.0.0.0") for _ in range(count)]


def write_kubeconfig(path: Path, server: str, token: str = "test-token") -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server.rstrip("/")}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}]}))
    return path


class OperatorProcess:
    """``kv-offload operator`` in its own process, talking to kmock through a kubeconfig."""

    def __init__(self, workdir: Path, server: str, *, extra_args: Sequence[str] = (),
                 scope: Sequence[str] = ("--namespace", NAMESPACE), token: str = "test-token",
                 env: Mapping[str, str] | None = None, webhook_tls: bool = False,
                 command: Callable[[OperatorProcess], Sequence[str]] | None = None) -> None:
        self.workdir = workdir
        # With webhook_tls, the webhook serves a certificate of a fresh test CA (``ca``, trusted by ``Webhook``).
        self.ca: Path | None = make_tls(workdir / "certs") if webhook_tls else None
        self.kubeconfig = write_kubeconfig(workdir / "kubeconfig", server, token)
        self.health_port, self.webhook_port, self.metrics_port = free_ports(3)
        self.env = dict(env or {})
        self.extra_args = [*(["--webhook-cert-dir", str(workdir / "certs")] if webhook_tls else []), *extra_args]
        self.scope = list(scope)
        self.proc: asyncio.subprocess.Process | None = None
        self.runs = 0
        # The whole command line, from this process's ports (the chart's Deployment, say), instead of the default.
        self.command = command

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.runs}.log"

    async def start(self) -> None:
        self.runs += 1
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1", **self.env)
        log = open(self.log_path, "wb")
        argv = self.command(self) if self.command is not None else [
            KV_OFFLOAD, "operator", *self.scope,
            "--health-port", str(self.health_port), "--webhook-port", str(self.webhook_port),
            "--metrics-port", str(self.metrics_port),
            "--webhook-addr", "127.0.0.1", "--sidecar-image", SIDECAR_IMAGE, "--verbose", *self.extra_args]
        self.proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return int(self.proc.returncode or 0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def __aenter__(self) -> "OperatorProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if exc[0] is not None:
            sys.stderr.write(f"--- operator log (run {self.runs}) ---\n{self.log()[-8000:]}\n")


def make_tls(directory: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 in ``directory`` (tls.crt, tls.key); returns ca.crt."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-offload test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-offload-webhook")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return directory / "ca.crt"
