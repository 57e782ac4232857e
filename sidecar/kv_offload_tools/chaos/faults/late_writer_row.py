"""The chaos bench's "late writer" row: no byte lands in a slot or a row after its transfer's
deadline, per data plane, against real holder sidecars (issue 47, item 6).

Per socket plane (tcp, and tls, the tcp transport with the pool's certificates) this process
is the fetcher: it does the pool handshake with a holder sidecar of a pool of its own (one holder of ``BIG_CHUNK``
chunks, one of ``SMALL_CHUNK`` chunks, each
chunk ``chunk_content(key)``), connects to its data port with the plane's client, and runs the
two cases of ``chaos.late_writer`` ``runs`` times each, on the process's chaos loop
(``chaos.loop``), which they block on purpose:

- ``holder_stopped``: the holder sidecar SIGSTOPped mid-chunk, the loop blocked past the row's
  deadline, the holder SIGCONTed; then two chunks fetched into the reused slot must verify.
- ``loop_blocked``: the loop blocked past the rows' deadline while the holder keeps sending.

ucx and nixl (``SLOT_PLANES``): the cases of ``chaos.late_slot_writer`` (the ones the tests run),
``runs`` times in a fetcher process of their own (UCX and NIXL read their environment once per
process) against one holder sidecar of ``BIG_CHUNK`` chunks of the plane: ucx its
``holder_stopped`` (the holder's put_zcopy stopped mid-chunk past the fetch's deadline: the
slot must stay held until the write is over, ``slots_held``), nixl its ``loop_blocked`` (the
read job posted past the deadline: the lane's gate must refuse the READ). NIXL's
holder_stopped needs UCX's tcp transport, where the holder crashes today (see that module).

Figures per plane (``LateWriterResult``): runs of each case, runs in which the fault struck a
transfer in flight, bytes written into a row or slot after the deadline (sentinel bytes
overwritten plus ``late_writes().bytes_after_deadline``; must be 0), writes the gates
refused, chunks stored after a cut (into a reused slot) and those that verified (all must),
and cut fetches that ended otherwise than by the fetcher's own ``ReceiveStopped``.
The invariant (``ok``) is 0 bytes after a deadline, every stored chunk verified, every cut
fetch ended as expected, and the fault in flight in at least one run of each case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_offload_tools.chaos import late_writer as late_cases
from kv_offload_tools.chaos import loop
from kv_offload_tools.chaos.chunks import chunk_content, chunk_keys, store_chunks
from kv_offload_tools.chaos.late_writer import BIG_CHUNK, SMALL_CHUNK, SMALL_CHUNKS
from kv_offload_tools.chaos.pool import chaos_pool
from kv_offload_tools.chaos.probes import probe_handshake
from kv_offload_testing.local_pool import LocalPool

# The planes the row runs on.
LATE_WRITER_PLANES = ("tcp", "tls", "ucx", "nixl")
# Planes whose bytes the holder writes (UCX) or the fetcher READs (NIXL) into a slot without a
# socket: their cases (``chaos.late_slot_writer``) run in a fetcher process of their own.
SLOT_PLANES = ("ucx", "nixl")
# UCX_TLS of the ucx holders and their fetcher: put_zcopy over shared memory.
UCX_ROW_TLS = "sm,self"
# Seconds from a row's offer to its deadline: far above the first byte's arrival on this host,
# short so a run is quick (a run whose first byte came later counts as not in flight).
ROW_SECONDS = 0.5

Progress = Callable[[str], None]


@dataclass
class LateWriterResult:
    """The late-writer figures of one plane."""

    # Data plane: "tcp" or "tls".
    plane: str
    # Runs of each case.
    runs: int = 0
    # Runs in which the holder was stopped mid-chunk before the row's deadline.
    holder_stopped_in_flight: int = 0
    # Runs in which rows were still being filled when the loop was blocked past their deadline
    # (nixl: the read job was posted past the fetch's deadline).
    loop_blocked_in_flight: int = 0
    # The cases run ("holder_stopped", "loop_blocked"; ucx runs the first, nixl the second).
    cases: tuple[str, ...] = ("holder_stopped", "loop_blocked")
    # ucx, nixl: slots still held once the fetch had given up while a write could go on (each
    # run in flight, and a run whose holder wrote the last byte but not yet its completion).
    slots_held: int = 0
    # Bytes written into a row or slot after its deadline (must be 0).
    bytes_after_deadline: int = 0
    # Writes the gates refused (past the deadline or given up) in each case.
    refused_holder_stopped: int = 0
    refused_loop_blocked: int = 0
    # Chunks stored after a cut (the slot reused, or slots of chunks whose rows had expired).
    chunks_stored: int = 0
    # Of those, chunks whose bytes verified (must be all).
    chunks_verified: int = 0
    # Cut fetches that ended otherwise than by the fetcher's own ReceiveStopped (must be 0).
    unexpected_endings: int = 0
    # Wall-clock seconds of the plane's runs.
    seconds: float = 0.0
    # Free-form observations (one line each).
    notes: list[str] = field(default_factory=list)

    @property
    def writes_refused(self) -> int:
        return self.refused_holder_stopped + self.refused_loop_blocked

    @property
    def ok(self) -> bool:
        return (self.bytes_after_deadline == 0 and self.chunks_verified == self.chunks_stored
                and self.unexpected_endings == 0
                and ("holder_stopped" not in self.cases or self.holder_stopped_in_flight > 0)
                and ("loop_blocked" not in self.cases or self.loop_blocked_in_flight > 0))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["writes_refused"] = self.writes_refused
        d["ok"] = self.ok
        return d


def late_writer(runs: int, progress: Progress | None = None,
                planes: tuple[str, ...] = LATE_WRITER_PLANES) -> list[LateWriterResult]:
    """``runs`` runs of each case per plane; one result per plane."""
    progress = progress or (lambda line: None)
    return [(_slot_plane if plane in SLOT_PLANES else _plane)(plane, runs, progress) for plane in planes]


@dataclass(frozen=True)
class _Holder:
    """A holder sidecar of chunks of one size, and how to reach its data plane."""

    pool: LocalPool
    keys: list[bytes]
    connect: Callable[[], Any]
    pid: int
    # The holder's data address and the session (id, key) of the handshake.
    address: str = ""
    session: tuple[bytes, bytes] = (b"", b"")


def _plane(plane: str, runs: int, progress: Progress) -> LateWriterResult:
    from kv_offload_sidecar.store.chunk_store import ChunkStore

    result = LateWriterResult(plane, runs=runs)
    started = time.monotonic()
    with _certificates(plane) as tls, _holder(plane, BIG_CHUNK, 2, tls) as big, \
            _holder(plane, SMALL_CHUNK, SMALL_CHUNKS, tls) as small:
        big_bytes = _contents(big.keys, BIG_CHUNK)
        small_bytes = _contents(small.keys, SMALL_CHUNK)
        big_store = ChunkStore(BIG_CHUNK, 3 * _stride(BIG_CHUNK), directory=big.pool.workdir)
        small_store = ChunkStore(SMALL_CHUNK, (SMALL_CHUNKS + 1) * _stride(SMALL_CHUNK),
                                 directory=small.pool.workdir)
        try:
            for r in range(runs):
                big_store.drop_when_released(big_store.keys())
                stopped = loop.run(late_cases.holder_stopped_past_deadline(
                    big.connect, big_store, big.keys, big_bytes.__getitem__, big.pid, ROW_SECONDS))
                small_store.drop_when_released(small_store.keys())
                blocked = loop.run(late_cases.loop_blocked_past_deadline(
                    small.connect, small_store, small.keys, small_bytes.__getitem__, ROW_SECONDS))
                result.holder_stopped_in_flight += stopped.stopped_mid_chunk
                result.loop_blocked_in_flight += blocked.late_rows > 0
                result.bytes_after_deadline += stopped.bytes_after_deadline + blocked.bytes_after_deadline
                result.refused_holder_stopped += stopped.refused
                result.refused_loop_blocked += blocked.refused
                result.chunks_stored += stopped.refetched + blocked.stored
                result.chunks_verified += stopped.verified + blocked.verified
                for case, outcome in (("holder_stopped", stopped.outcome), ("loop_blocked", blocked.outcome)):
                    if not late_cases.ended_as_expected(outcome):
                        result.unexpected_endings += 1
                        result.notes.append(f"run {r} {case}: the fetch ended with {outcome!r}")
                if (r + 1) % 10 == 0 or r + 1 == runs:
                    progress(f"late writer on {plane}: {r + 1}/{runs} runs, "
                             f"{result.bytes_after_deadline} bytes after a deadline, "
                             f"{result.writes_refused} writes refused")
        finally:
            big_store.close()
            small_store.close()
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _slot_plane(plane: str, runs: int, progress: Progress) -> LateWriterResult:
    """ucx, nixl: the plane's cases (``late_slot_writer.PLANE_CASES``) run ``runs`` times by a
    fetcher process of their own against one holder sidecar of ``BIG_CHUNK`` chunks."""
    import os

    from kv_offload_tools.chaos.late_slot_writer import PLANE_CASES, run_fetcher

    cases = PLANE_CASES[plane]
    result = LateWriterResult(plane, runs=runs, cases=cases)
    started = time.monotonic()
    tls = UCX_ROW_TLS if plane == "ucx" else os.environ.get("UCX_TLS", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    if tls:
        env["UCX_TLS"] = tls
    with _holder(plane, BIG_CHUNK, 2, None, env) as big:
        fetched = run_fetcher(plane, ucx_tls=tls, address=big.address, holder_pid=big.pid,
                              session=big.session, contents=_contents(big.keys, BIG_CHUNK),
                              shm_dir=big.pool.workdir, runs=runs, env=env, timeout=60 + 30 * runs)
    for i, run in enumerate(fetched):
        case = run["case"]
        if case == "holder_stopped":
            result.holder_stopped_in_flight += run["in_flight"]
            result.refused_holder_stopped += run["refused"]
        else:
            result.loop_blocked_in_flight += run["in_flight"]
            result.refused_loop_blocked += run["refused"]
        result.slots_held += run["held_by_failure"]
        result.bytes_after_deadline += run["bytes_after_deadline"]
        result.chunks_stored += run["refetched"]
        result.chunks_verified += run["verified"]
        # A fetch ends at its deadline, or returns the chunk when the holder's SIGSTOP came
        # after its last byte (the case did not happen: not in flight).
        ended = "deadline" in (run["error"] or "") or not (run["in_flight"] or run["error"])
        if case == "holder_stopped" and run["in_flight"] and not run["held_by_failure"]:
            result.unexpected_endings += 1
            result.notes.append(f"run {i // len(cases)} {case}: the slot was free while the stopped "
                                f"holder's write could go on")
        if not ended or run["held_at_end"] or run["refetch_error"]:
            result.unexpected_endings += 1
            result.notes.append(f"run {i // len(cases)} {case}: the fetch ended with {run['error']!r}, "
                                f"{run['held_at_end']} slots held after, refetch: {run['refetch_error']!r}")
    progress(f"late writer on {plane}: {runs} runs, {result.bytes_after_deadline} bytes after a "
             f"deadline, {result.writes_refused} writes refused, {result.slots_held} slots held")
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _contents(keys: list[bytes], nbytes: int) -> dict[bytes, bytes]:
    return {key: chunk_content(key, nbytes) for key in keys}


def _stride(chunk_bytes: int) -> int:
    from kv_offload_sidecar.engine.store_view import slot_stride_for

    return slot_stride_for(chunk_bytes)


@contextlib.contextmanager
def _certificates(plane: str) -> Iterator[Any]:
    """tls: the pool's certificates (one for the holders, one for this fetcher); else None."""
    if plane != "tls":
        yield None
        return
    import tempfile

    from kv_offload_testing.certs import pool_certificates

    with tempfile.TemporaryDirectory(prefix="kvo-late-writer-") as directory:
        yield pool_certificates(directory, ["holder", "fetcher"])


@contextlib.contextmanager
def _holder(plane: str, chunk_bytes: int, chunks: int, certs: Any,
            env: dict[str, str] | None = None) -> Iterator[_Holder]:
    """A one-sidecar pool holding ``chunks`` chunks of ``chunk_bytes``, and a connect to it
    (``env``: the sidecar's UCX environment, e.g. its UCX_TLS)."""
    from kv_offload_sidecar.data import connect

    ctx = None
    extra: tuple[str, ...] = ()
    if certs is not None:
        from kv_offload_sidecar.data.tls import client_context

        files, mine = certs["holder"], certs["fetcher"]
        extra = ("--tls-cert-file", files.cert_file, "--tls-key-file", files.key_file,
                 "--tls-ca-file", files.ca_file)
        ctx = client_context(mine.cert_file, mine.key_file, mine.ca_file)
    transport = plane if plane in SLOT_PLANES else "tcp"
    with chaos_pool(chunk_bytes, (chunks + 2) * _stride(chunk_bytes), extra_args=extra,
                    transport=transport) as pool:
        pool.env.update({k: v for k, v in (env or {}).items() if k.startswith("UCX_")})
        sc = pool.add(identity="holder", peers=[])
        keys = chunk_keys(f"late-writer-{chunk_bytes}", chunks)
        with sc.client() as engine:
            if store_chunks(engine, keys, chunk_bytes) != chunks:
                raise RuntimeError(f"the {plane} holder stored fewer than {chunks} chunks")
        hello = pool.local_hello(identity="late-writer")
        scheme = "tls" if ctx is not None else transport
        hello = dataclasses.replace(hello, data_address=f"{scheme}://127.0.0.1:9")
        probe = probe_handshake(sc, pool.pool_key, hello)
        session = probe.session

        def connect_holder() -> Any:
            return connect(probe.server_hello.data_address, session.session_id, session.session_key,
                           timeout=10, ssl=ctx)

        assert sc.proc is not None
        yield _Holder(pool, keys, connect_holder, sc.proc.pid, probe.server_hello.data_address,
                      (session.session_id, session.session_key))


__all__ = ["LATE_WRITER_PLANES", "LateWriterResult", "late_writer"]
