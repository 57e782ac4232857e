"""The TCP data plane under mutual TLS: real servers and clients, throw-away pool CAs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from kv_offload_sidecar.data import TransportError, connect, make_server
from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.data.base import ReceiveStopped
from kv_offload_sidecar.data.tcp.stream_worker import OFF_LOOP_BYTES
from kv_offload_sidecar.data.tcp.tls_stream import TlsStream, open_tls
from kv_offload_sidecar.data.tls import client_context, memory_handshake, server_context
from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_sidecar.metrics import SidecarMetrics
from kv_offload_sidecar.store.chunk_store import ChunkStore
from kv_offload_testing.certs import CertFiles, pool_certificates
from peer_processes import PeerProcess
from prometheus_client import CollectorRegistry
from transport_peers import (SESSION_ID, SESSION_KEY, assert_still_serves, chunk_bytes_in, content_of,
                             hold_chunks, key_of, session)
from waiting import wait_for_async

CHUNK = 256 * 1024


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    """The pool's CA and a certificate each for a server and a client."""
    return pool_certificates(tmp_path_factory.mktemp("pool"), ["server", "client"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    """Another CA's certificates: valid TLS material the pool does not trust."""
    return pool_certificates(tmp_path_factory.mktemp("foreign"), ["server", "client"])


def client_ctx(files: CertFiles) -> ssl.SSLContext:
    return client_context(files.cert_file, files.key_file, files.ca_file)


def unchecked_client_ctx(cert_file: str | None, key_file: str | None, ca_file: str) -> ssl.SSLContext:
    """A client context client_context would refuse to build (a peer that is not one of ours)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            part = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return data
        if not part:
            return data
        data += part


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize(("chunk_bytes", "chunks"), [(CHUNK, 16), (2 << 20, 8), (16 << 20, 3)])
async def test_tls_fetch_moves_chunks_byte_identical(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore],
        pool: dict[str, CertFiles], chunk_bytes: int, chunks: int) -> None:
    peer = start_peer("tcp", chunks=chunks, chunk_bytes=chunk_bytes, certs=pool["server"])
    assert peer.address.startswith("tls://127.0.0.1:")
    metrics = SidecarMetrics(CollectorRegistry())
    store = make_store(slots=chunks + 1, chunk_bytes=chunk_bytes)
    keys = [key_of(i) for i in range(chunks)]
    async with session(peer.address, timeout=10, metrics=metrics, ssl=client_ctx(pool["client"])) as client:
        assert await client.lookup(keys + [key_of(999)], timeout=5) == chunks
        lookups = await asyncio.gather(*(client.lookup(keys[:n], timeout=5) for n in range(1, chunks + 1)))
        assert lookups == list(range(1, chunks + 1))
        assert await client.fetch(keys, store, timeout=30) == chunks
        assert await client.fetch([key_of(999)], store, timeout=5) == 0  # a miss keeps the connection
        assert not client.closed
    for i, key in enumerate(keys):
        assert chunk_bytes_in(store, key) == content_of(i, chunk_bytes)
    assert metrics.peer_bytes.labels(direction="received")._value.get() == chunks * chunk_bytes
    assert peer.metrics()["peer_bytes_sent"] == chunks * chunk_bytes


async def test_in_process_tls_server_advertises_tls_and_says_goodbye_on_stop(
        make_store: Callable[..., ChunkStore], pool: dict[str, CertFiles]) -> None:
    source = make_store()
    hold_chunks(source, 3, CHUNK)
    p = pool["server"]
    server = make_server("tcp", source, {SESSION_ID: SESSION_KEY}.get, None, chunk_bytes=CHUNK,
                         ssl=server_context(p.cert_file, p.key_file, p.ca_file))
    address = await server.start()
    assert address.startswith("tls://127.0.0.1:")
    dest = make_store()
    async with session(address, ssl=client_ctx(pool["client"])) as client:
        assert await client.fetch([key_of(i) for i in range(3)], dest, timeout=5) == 3
        await server.stop(0.5)
        with pytest.raises(TransportError):
            await client.lookup([key_of(0)], timeout=2)
        assert client.closed
    assert [chunk_bytes_in(dest, key_of(i)) for i in range(3)] == [content_of(i, CHUNK) for i in range(3)]


async def test_tls_server_killed_mid_fetch_fails_within_deadline_leaving_nothing_partial(
        start_peer: Callable[..., PeerProcess], shm_dir: str, pool: dict[str, CertFiles]) -> None:
    big = 1 << 20
    peer = start_peer("tcp", chunks=48, chunk_bytes=big, certs=pool["server"])
    killed: list[bool] = []

    def kill_on_first_chunk(key: bytes, present: bool) -> None:
        if present and not killed:
            killed.append(True)
            os.kill(peer.pid, signal.SIGKILL)

    store = ChunkStore(big, 50 * slot_stride_for(big), directory=shm_dir, name=f"tls-kill-{os.getpid()}",
                       on_change=kill_on_first_chunk)
    try:
        client = await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, ssl=client_ctx(pool["client"]))
        with pytest.raises(TransportError) as failed:
            await client.fetch([key_of(i) for i in range(48)], store, timeout=5)
        assert "deadline" not in str(failed.value)  # it ended with the connection, not by the deadline
        assert killed and client.closed
        assert 1 <= len(store) < 48
        for key in store.keys():
            assert chunk_bytes_in(store, key) == content_of([key_of(i) for i in range(48)].index(key), big)
        assert store.used_bytes == len(store) * store.slot_stride
    finally:
        store.close()


# ------------------------------------------------------------------ refusals


async def test_client_certificate_of_another_ca_is_refused_and_the_server_keeps_serving(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore],
        pool: dict[str, CertFiles], foreign: dict[str, CertFiles]) -> None:
    peer = start_peer("tcp", chunks=2, certs=pool["server"])
    # Trusts the pool's server, but presents a certificate of another CA.
    outsider = unchecked_client_ctx(foreign["client"].cert_file, foreign["client"].key_file,
                                    pool["client"].ca_file)
    with pytest.raises(TransportError, match="most likely refused this pod's certificate"):
        await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, ssl=outsider)
    # A client without any certificate gets no further.
    bare = unchecked_client_ctx(None, None, pool["client"].ca_file)
    with pytest.raises(TransportError):
        await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, ssl=bare)
    await assert_still_serves(peer.address, make_store(), ssl=client_ctx(pool["client"]))
    assert peer.metrics()["protocol_errors"]["unauthenticated"] == 2
    assert peer.alive()


async def test_server_certificate_of_another_ca_is_refused_by_the_client(
        start_peer: Callable[..., PeerProcess], pool: dict[str, CertFiles],
        foreign: dict[str, CertFiles]) -> None:
    peer = start_peer("tcp", chunks=1, certs=foreign["server"])
    with pytest.raises(TransportError, match="certificate is not signed by this pod's --tls-ca-file"):
        await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, ssl=client_ctx(pool["client"]))


async def test_client_without_tls_to_a_tls_server_fails_cleanly(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore],
        pool: dict[str, CertFiles]) -> None:
    peer = start_peer("tcp", chunks=2, certs=pool["server"], auth_timeout=1.0)
    with pytest.raises(TransportError, match="encrypts its data plane.*--tls-cert-file"):
        await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5)
    # Dialled as plain TCP anyway (a stale address): no cleartext nonce, a deadline, no crash.
    plain = "tcp://" + peer.address.removeprefix("tls://")
    with pytest.raises(TransportError, match="deadline"):
        await connect(plain, SESSION_ID, SESSION_KEY, timeout=0.5)
    # Cleartext protocol bytes are refused in the handshake; the server never answers in clear.
    sock = socket.create_connection(host_port(peer.address), timeout=5)
    sock.sendall(proto.join(proto.encode_auth_response(SESSION_ID, bytes(32))) * 4)
    reply = read_until_closed(sock)
    sock.close()
    assert proto.MAGIC not in reply
    await assert_still_serves(peer.address, make_store(), ssl=client_ctx(pool["client"]))
    assert peer.metrics()["protocol_errors"]["unauthenticated"] >= 1
    assert peer.alive()


async def test_tls_client_to_a_plain_server_fails_cleanly(
        start_peer: Callable[..., PeerProcess], make_store: Callable[..., ChunkStore],
        pool: dict[str, CertFiles]) -> None:
    peer = start_peer("tcp", chunks=2)
    assert peer.address.startswith("tcp://")
    ctx = client_ctx(pool["client"])
    with pytest.raises(TransportError, match="this pod requires TLS; peer .* serves plain TCP"):
        await connect(peer.address, SESSION_ID, SESSION_KEY, timeout=5, ssl=ctx)
    # Dialled as TLS anyway: the handshake meets a cleartext nonce and fails, within the deadline.
    with pytest.raises(TransportError, match="TLS with tls://.*does not speak TLS there"):  # not the deadline
        await connect("tls://" + peer.address.removeprefix("tcp://"), SESSION_ID, SESSION_KEY,
                      timeout=5, ssl=ctx)
    await assert_still_serves(peer.address, make_store())
    assert peer.alive()


async def test_tls_pod_refuses_a_ucx_peer_and_tls_is_tcp_only(pool: dict[str, CertFiles]) -> None:
    with pytest.raises(TransportError, match="serves UCX, which is not encrypted"):
        await connect("ucx://AAAA", SESSION_ID, SESSION_KEY, timeout=1, ssl=client_ctx(pool["client"]))
    p = pool["server"]
    with pytest.raises(ValueError, match="tcp data plane only"):
        make_server("ucx", None, lambda s: None, None, chunk_bytes=1,  # type: ignore[arg-type]
                    ssl=server_context(p.cert_file, p.key_file, p.ca_file))


# ------------------------------------------------------------------ the stream


async def tls_pair(pool: dict[str, CertFiles]) -> tuple[TlsStream, TlsStream]:
    """A server and a client stream over a socket pair, handshaken."""
    s, c = pool["server"], pool["client"]
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
    server_task = asyncio.create_task(open_tls(a, server_context(s.cert_file, s.key_file, s.ca_file),
                                               server_side=True, timeout=5))
    client = await open_tls(b, client_ctx(c), server_side=False, timeout=5)
    return await server_task, client


async def test_tls_stream_reads_exactly_across_records_on_the_loop_and_on_its_thread(
        pool: dict[str, CertFiles]) -> None:
    """Odd-sized reads straddling records, a chunk-sized read decrypted and hashed on the
    connection's own thread (not the loop's), and a writer far ahead of the reader (it waits
    for the socket; nothing is lost or reordered)."""
    server, client = await tls_pair(pool)
    payload = os.urandom(3 * OFF_LOOP_BYTES + 12345)
    try:
        sending = asyncio.create_task(server.send([payload[:7], memoryview(payload)[7:]]))
        got = bytearray()
        for n in [16, 2, 3, 65535, 1]:
            buf = bytearray(n)
            await client.recv_into(buf)
            got += buf
        assert not sending.done()  # the writer is ahead, held back by the socket
        big = bytearray(OFF_LOOP_BYTES + 5)
        pieces: list[bytes] = []
        threads: set[int] = set()

        def on_piece(piece: memoryview) -> None:
            threads.add(threading.get_ident())
            pieces.append(bytes(piece))

        await client.recv_into(big, on_piece=on_piece, piece_bytes=256 << 10)
        assert threads and threading.get_ident() not in threads  # decrypted off the loop
        assert b"".join(pieces) == big and len(pieces) > 1
        got += big
        rest = bytearray(len(payload) - len(got))
        await client.recv_into(memoryview(rest))
        got += rest
        await sending
        assert bytes(got) == payload
        server.close()  # close_notify: the reader sees the end, not a TLS error
        with pytest.raises(ConnectionError, match="after 0 of 10 bytes"):
            await client.recv_into(bytearray(10))
    finally:
        client.close()
        server.close()


async def test_aborting_a_tls_stream_stops_its_thread_mid_chunk_and_wakes_loop_readers(
        pool: dict[str, CertFiles]) -> None:
    """A chunk half received on the thread and a header awaited on the loop both end at
    abort(), and no byte lands in the chunk's buffer after abort() returned."""
    server, client = await tls_pair(pool)
    try:
        big = bytearray(OFF_LOOP_BYTES)
        landed: list[int] = []
        receiving = asyncio.create_task(client.recv_into(
            big, on_piece=lambda piece: landed.append(len(piece)), piece_bytes=16 << 10))
        await server.send([os.urandom(OFF_LOOP_BYTES // 2)])  # half a chunk, then silence
        await wait_for_async("half the chunk landed", lambda: sum(landed) >= OFF_LOOP_BYTES // 2)
        header = asyncio.create_task(server.recv_into(bytearray(16)))
        await asyncio.sleep(0)
        client.abort()
        after = bytes(big)
        server.abort()
        with pytest.raises(ReceiveStopped):
            await receiving
        with pytest.raises(ConnectionError):
            await header
        assert bytes(big) == after
    finally:
        client.close()
        server.close()


# ------------------------------------------------------------------ loading


def test_bad_tls_files_name_the_file_and_the_fix(tmp_path: Path, pool: dict[str, CertFiles],
                                                 foreign: dict[str, CertFiles]) -> None:
    p = pool["server"]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for make in (server_context, client_context):
        with pytest.raises(ValueError, match=f"--tls-cert-file {tmp_path}/missing.crt: no such file"):
            make(str(tmp_path / "missing.crt"), p.key_file, p.ca_file)
        with pytest.raises(ValueError, match=f"--tls-key-file {tmp_path}/missing.key: no such file"):
            make(p.cert_file, str(tmp_path / "missing.key"), p.ca_file)
        with pytest.raises(ValueError, match=f"--tls-ca-file {junk}: not the pool's CA certificate in PEM"):
            make(p.cert_file, p.key_file, str(junk))
        with pytest.raises(ValueError, match=f"--tls-cert-file {junk}: not this sidecar's certificate in PEM"):
            make(str(junk), p.key_file, p.ca_file)
        with pytest.raises(ValueError, match=f"--tls-key-file {p.cert_file}: not the private key"):
            make(p.cert_file, p.cert_file, p.ca_file)
        with pytest.raises(ValueError, match=f"--tls-key-file {foreign['server'].key_file} does not match "
                                             f"--tls-cert-file {p.cert_file}"):
            make(p.cert_file, foreign["server"].key_file, p.ca_file)


def test_a_certificate_the_peers_would_refuse_fails_at_load(
        tmp_path: Path, pool: dict[str, CertFiles], foreign: dict[str, CertFiles]) -> None:
    server_only = pool_certificates(tmp_path, ["member"], usages=["server auth"])["member"]
    for make in (server_context, client_context):
        with pytest.raises(ValueError, match=f"--tls-cert-file {server_only.cert_file} would be refused by "
                                             r"the pool's peers \(unsuitable certificate purpose\): it must "
                                             "allow both server auth and client auth"):
            make(server_only.cert_file, server_only.key_file, server_only.ca_file)
        other = foreign["client"]
        with pytest.raises(ValueError, match=f"--tls-cert-file {other.cert_file} would be refused by the "
                                             "pool's peers .*not signed by --tls-ca-file"):
            make(other.cert_file, other.key_file, pool["client"].ca_file)


def test_contexts_are_mutual_tls13_without_host_names(pool: dict[str, CertFiles]) -> None:
    p = pool["server"]
    for ctx in (server_context(p.cert_file, p.key_file, p.ca_file), client_ctx(pool["client"])):
        assert ctx.minimum_version is ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode is ssl.CERT_REQUIRED
        assert not ctx.check_hostname


def test_a_renewed_certificate_is_loaded_into_the_live_contexts(tmp_path, pool, foreign):
    import shutil

    from kv_offload_sidecar.data.tls import TlsContexts

    mine = CertFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    for src, dst in ((pool["server"].cert_file, mine.cert_file), (pool["server"].key_file, mine.key_file),
                     (pool["server"].ca_file, mine.ca_file)):
        shutil.copy(src, dst)
    live = TlsContexts(mine.cert_file, mine.key_file, mine.ca_file)
    assert live.reload() is False  # nothing changed
    assert memory_handshake(live.server, client_ctx(pool["client"]))
    with pytest.raises(ssl.SSLError):  # a peer of the new CA is not trusted yet
        memory_handshake(live.server, client_ctx(foreign["client"]))
    # cert-manager renews into a new CA: the mounted files change under the running sidecar
    for src, dst in ((foreign["server"].cert_file, mine.cert_file), (foreign["server"].key_file, mine.key_file),
                     (foreign["server"].ca_file, mine.ca_file)):
        shutil.copy(src, dst)
    assert live.reload() is True
    seen = memory_handshake(live.server, client_ctx(foreign["client"]))
    assert seen == ssl.PEM_cert_to_DER_cert(Path(foreign["server"].cert_file).read_text())
    # a half-written renewal does not load: the contexts keep the renewed certificate
    Path(mine.key_file).write_bytes(b"-----BEGIN PRIVATE KEY-----\ntruncated")
    with pytest.raises(ValueError, match="--tls-"):
        live.reload()
    assert memory_handshake(live.server, client_ctx(foreign["client"])) == seen


# ------------------------------------------------------------------ CA rotation


@pytest.fixture
def rotation(tmp_path: Path, pool: dict[str, CertFiles], foreign: dict[str, CertFiles]) -> CertFiles:
    """This sidecar's files mid-rotation from ``pool``'s CA to ``foreign``'s: a certificate of the
    new CA, and a CA bundle that still trusts the old one."""
    mine = CertFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    Path(mine.cert_file).write_bytes(Path(foreign["server"].cert_file).read_bytes())
    Path(mine.key_file).write_bytes(Path(foreign["server"].key_file).read_bytes())
    Path(mine.ca_file).write_bytes(Path(pool["server"].ca_file).read_bytes()
                                   + Path(foreign["server"].ca_file).read_bytes())
    return mine


def old_ca_server_ctx(old: CertFiles, bundle: str) -> ssl.SSLContext:
    """A peer still on the old CA's certificate, trusting the bundle."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(old.cert_file, old.key_file)
    ctx.load_verify_locations(bundle)
    return ctx


def test_a_ca_removed_from_the_bundle_is_no_longer_trusted_after_reload(
        rotation: CertFiles, pool: dict[str, CertFiles], foreign: dict[str, CertFiles]) -> None:
    from kv_offload_sidecar.data.tls import TlsContexts

    live = TlsContexts(rotation.cert_file, rotation.key_file, rotation.ca_file)
    old_client = unchecked_client_ctx(pool["client"].cert_file, pool["client"].key_file, rotation.ca_file)
    new_client = unchecked_client_ctx(foreign["client"].cert_file, foreign["client"].key_file, rotation.ca_file)
    old_server = old_ca_server_ctx(pool["server"], rotation.ca_file)
    assert memory_handshake(live.server, old_client) and memory_handshake(old_server, live.client) is not None
    # The rotation ends: the old CA leaves the bundle.
    Path(rotation.ca_file).write_bytes(Path(foreign["server"].ca_file).read_bytes())
    assert live.reload() is True
    with pytest.raises(ssl.SSLError):  # a peer dialling us with the old CA's certificate
        memory_handshake(live.server, old_client)
    with pytest.raises(ssl.SSLCertVerificationError):  # a peer we dial that serves one
        memory_handshake(old_server, live.client)
    assert memory_handshake(live.server, new_client)
    assert memory_handshake(old_ca_server_ctx(foreign["server"], rotation.ca_file), live.client)


async def test_after_a_ca_rotation_open_connections_stay_and_new_ones_are_checked_against_the_new_bundle(
        make_store: Callable[..., ChunkStore], rotation: CertFiles, pool: dict[str, CertFiles],
        foreign: dict[str, CertFiles]) -> None:
    from kv_offload_sidecar.data.tls import TlsContexts

    live = TlsContexts(rotation.cert_file, rotation.key_file, rotation.ca_file)
    source = make_store()
    hold_chunks(source, 2, CHUNK)
    server = make_server("tcp", source, {SESSION_ID: SESSION_KEY}.get, None, chunk_bytes=CHUNK, ssl=live.server)
    address = await server.start()
    old_client = unchecked_client_ctx(pool["client"].cert_file, pool["client"].key_file, rotation.ca_file)
    try:
        async with session(address, ssl=old_client) as opened_before:
            Path(rotation.ca_file).write_bytes(Path(foreign["server"].ca_file).read_bytes())
            assert live.reload() is True
            # The rule (data/tls.py): a connection keeps the peer its handshake verified.
            assert await opened_before.fetch([key_of(0), key_of(1)], make_store(), timeout=5) == 2
            with pytest.raises(TransportError):
                await connect(address, SESSION_ID, SESSION_KEY, timeout=5, ssl=old_client)
        new_client = unchecked_client_ctx(foreign["client"].cert_file, foreign["client"].key_file,
                                          rotation.ca_file)
        await assert_still_serves(address, make_store(), ssl=new_client)
    finally:
        await server.stop(0.5)


def test_a_sidecars_next_outbound_connection_takes_the_reloaded_client_context(
        make_settings: Callable[..., object], rotation: CertFiles, foreign: dict[str, CertFiles]) -> None:
    from kv_offload_sidecar.sidecar import Sidecar

    sidecar = Sidecar(make_settings(tls_cert_file=rotation.cert_file, tls_key_file=rotation.key_file,
                                    tls_ca_file=rotation.ca_file))
    before = sidecar.peers._data_options()["ssl"]
    Path(rotation.ca_file).write_bytes(Path(foreign["server"].ca_file).read_bytes())
    sidecar._reload_tls()
    assert sidecar.peers._data_options()["ssl"] is sidecar.tls.client is not before
