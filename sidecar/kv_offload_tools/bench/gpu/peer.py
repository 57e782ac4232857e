"""The peer hit of `bench gpu` as a pod does it, with real sidecar processes.

Two ``kv-offload sidecar`` processes on 127.0.0.1 (``LocalPool``) run the model's
pool config on the chosen data plane: the holder and the fetcher, each started on half
of this machine's CPUs (the holder on the first half, the fetcher on the second; one CPU:
both on it), so a data plane's lanes have cores to use; ``--lanes N`` is passed when
a lane count is asked for, else the sidecars choose. The bench process is the pods'
vLLM: one ``/dev/shm`` file mapped shared, laid out as vLLM's primary CPU tier (one row
per chunk, ``worker_kv_bytes_per_block x blocks_per_chunk`` bytes at a page-aligned stride)
and registered with ``cudaHostRegister`` on a GPU, attached to both sidecars through
their engine clients (``EngineClient(region=...)``), and a KV cache on the device shaped
as vLLM's: per layer ``(blocks, 2, kv_heads, block_tokens, head_dim)`` in bf16, a chunk's
row holding its blocks layer by layer.

Per pool: the longest prompt's chunks are written into the rows (distinct bytes per
chunk, their XXH3 digests kept) and stored into the holder with ``store_rows``, as vLLM
cascades them (``store_s``: until the fetcher's admin lookup sees them all at its peer);
the rows are zeroed. Then per prompt length (its leading chunks), ``repeats`` times:
``lookup`` on the fetcher (which starts the peer fetch), ``load_rows`` into the rows, and
the rows copied to the device cache (synchronized): the three phases of a hit; and its fixed
cost before bytes move, ``first_chunk_s``: the fetcher's time from its first chunk request (sent
with the lookup's LOOKUP) to that chunk verified (``kv_offload_peer_fetch_first_chunk_seconds``,
scraped before and after). The landed
rows must hold the holder's bytes (digests compared; on the first run the device copy of
the first chunk is compared with its row too), and are zeroed again before the next run.
The sidecars' CPU-seconds (``/proc/<pid>/stat``) are read before the lookup and after
the rows landed, and a thread polls the fetcher's ``/healthz`` all the while (its p99: how
long the fetcher's event loop keeps a probe waiting while chunks move). The store is sent as
the tier sends it beside an engine on a GPU (not paced) and timed until it landed in the
holder, against one thread's memcpy of the same bytes taken just before. A run that misses
(fewer chunks found or loaded) is reported as one. Last,
with the sidecars idle, raw TCP with as many streams as lanes (as the fetcher's status says it
runs when the sidecars chose; one where it says nothing), pinned the same way, moves the
longest hit's bytes (``raw_tcp``): the limit. Before the timed runs, one untimed hit of the
shortest prompt opens the connections.
"""

from __future__ import annotations

import contextlib
import http.client
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kv_offload_sidecar.engine.client import EngineClient, RowRegion
from kv_offload_sidecar.engine.engine_platform import paces_stores
from kv_offload_sidecar.engine.region_file import find_region_file
from kv_offload_tools.bench.attack.pool import cpu_seconds
from kv_offload_tools.bench.gpu.geometry import Geometry
from kv_offload_tools.bench.gpu.pinning import cpu_list, split_cpus, started_on
from kv_offload_tools.bench.gpu.raw_tcp import raw_tcp
from kv_offload_tools.bench.quantile import quantile
from kv_offload_testing.certs import pool_certificates
from kv_offload_testing.local_pool import LocalPool

# Chunks per store_rows call: each call must land within the client's control deadline.
STORE_BATCH_BYTES = 512 << 20
# Seconds the fetcher may take to see every stored chunk at its peer (directory publish).
VISIBLE_TIMEOUT_S = 60.0
# Most bytes of the raw TCP reference (the longest hit's KV, up to this).
RAW_TCP_MAX_BYTES = 2 << 30
# Bytes of the buffer the store's memcpy reference copies into, over and over (past the caches).
MEMCPY_PIECE_BYTES = 256 << 20
# Seconds between two /healthz polls of the fetcher while a hit runs.
HEALTH_POLL_INTERVAL_S = 0.002
# The engine this bench stands for computes on a GPU: its tier's stores are not paced.
ENGINE_DEVICE_TYPE = "cuda"


class HealthPolls:
    """While in its ``with`` block, a thread asks a sidecar's ``/healthz`` over and over on one
    kept-alive connection, ``HEALTH_POLL_INTERVAL_S`` apart: how long its event loop keeps a
    poll waiting (a kubelet's probe, Prometheus) while the chunks move."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-polls", daemon=True)
        # Seconds each poll took, request to whole answer.
        self.seconds: list[float] = []

    def __enter__(self) -> "HealthPolls":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=10)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                self.seconds.append(time.perf_counter() - t0)
                self._stop.wait(HEALTH_POLL_INTERVAL_S)
        finally:
            conn.close()

    def p99_ms(self) -> float | None:
        p99 = quantile(self.seconds, 0.99)
        return None if p99 is None else 1e3 * p99


@dataclass(frozen=True)
class PeerSettings:
    """How the peer hits run."""

    # Data plane of both sidecars: their --transport (tcp, ucx or nixl), or tls (tcp under
    # mutual TLS 1.3, certificates of a throw-away pool CA).
    plane: str = "tcp"
    # Runs per prompt length; the reported hit is the median run.
    repeats: int = 3
    # Seconds a lookup or load may take (the sidecars' fetch deadline and the client's timeout).
    timeout_s: float = 120.0
    # Folder of the region file (vLLM maps its primary tier from /dev/shm).
    shm_dir: str = "/dev/shm"


def _cuda_success(rc: Any) -> bool:
    """Whether a cudart call's result (an error enum, or a tuple starting with one) is success."""
    code = rc[0] if isinstance(rc, tuple) else rc
    try:
        return int(code) == 0
    except (TypeError, ValueError):
        return "success" in str(code).lower()


def _digest(row: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(row))


class HostRows:
    """vLLM's primary CPU tier: a shared-memory file mapped whole, one row per chunk."""

    def __init__(self, directory: str, rows: int, stride: int, chunk_bytes: int, dev: str) -> None:
        self.path = os.path.join(directory, f"vllm_offload_bench_gpu_{os.getpid()}.mmap")
        self.size = rows * stride
        self.chunk_bytes = chunk_bytes
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, self.size)
        self._map = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED)
        os.unlink(self.path)  # vLLM keeps the descriptor; the sidecars get it over the channel
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(rows, stride)
        self.rows[:] = 0  # fault every page in, as vLLM's region is before use
        found, reason = find_region_file(memoryview(self._map))
        if found is None:
            raise RuntimeError(f"the rows' file is not found as vLLM's would be: {reason}")
        self.spec = RowRegion(found, stride, rows, chunk_bytes)
        self.registered = None
        if dev == "cuda":
            import torch

            rc = torch.cuda.cudart().cudaHostRegister(self.rows.ctypes.data, self.size, 0)
            if not _cuda_success(rc):
                raise RuntimeError(f"cudaHostRegister of the {self.size}-byte region failed: {rc}")
            self.registered = self.rows.ctypes.data

    def chunk(self, row: int) -> np.ndarray:
        """The chunk bytes at the start of ``row`` (a view)."""
        return self.rows[row, :self.chunk_bytes]

    def fill(self, count: int, seed: int = 0) -> list[int]:
        """Distinct bytes into rows 0..count-1 (a random chunk rotated per row); their digests."""
        base = np.random.default_rng(seed).integers(0, 256, self.chunk_bytes, dtype=np.uint8)
        digests = []
        for r in range(count):
            shift = (r * 4099) % self.chunk_bytes
            row = self.chunk(r)
            row[:self.chunk_bytes - shift] = base[shift:]
            row[self.chunk_bytes - shift:] = base[:shift]
            row[:8] = np.frombuffer(r.to_bytes(8, "little"), dtype=np.uint8)
            digests.append(_digest(row))
        return digests

    def zero(self, count: int) -> None:
        self.rows[:count, :self.chunk_bytes] = 0

    def matches(self, digests: Sequence[int]) -> bool:
        """Whether rows 0..len(digests)-1 hold the chunks with those digests."""
        return all(_digest(self.chunk(r)) == d for r, d in enumerate(digests))

    def close(self) -> None:
        if self.registered is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None
        if self.spec.file.owned:
            os.close(self.spec.file.fd)
        del self.rows
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
            self._map.close()
        os.close(self._fd)


class DeviceKV:
    """vLLM's KV cache on the device: per layer ``(blocks, 2, kv_heads, block_tokens, head_dim)``."""

    def __init__(self, geometry: Geometry, chunks: int, dev: str) -> None:
        import torch

        self.g = geometry
        self.dev = dev
        shape = (chunks * geometry.blocks_per_chunk, 2, geometry.kv_heads, geometry.tokens_per_block,
                 geometry.head_dim)
        self.layers = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(geometry.layers)]

    def _row_layers(self, host: HostRows, row: int) -> Any:
        """A row's chunk as the device cache's blocks, layer by layer (a view of the row)."""
        import torch

        g = self.g
        return torch.from_numpy(host.chunk(row)).view(torch.bfloat16).view(
            g.layers, g.blocks_per_chunk, 2, g.kv_heads, g.tokens_per_block, g.head_dim)

    def copy_in(self, host: HostRows, chunks: int) -> None:
        """Rows 0..chunks-1 into blocks 0..chunks*blocks_per_chunk-1 of every layer, synchronized."""
        import torch

        bpc = self.g.blocks_per_chunk
        for c in range(chunks):
            src = self._row_layers(host, c)
            for layer, dst in enumerate(self.layers):
                dst[c * bpc:(c + 1) * bpc].copy_(src[layer], non_blocking=True)
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def holds_row(self, host: HostRows, row: int) -> bool:
        """Whether the device blocks of chunk ``row`` equal the row's bytes."""
        import torch

        bpc = self.g.blocks_per_chunk
        src = self._row_layers(host, row)
        return all(torch.equal(dst[row * bpc:(row + 1) * bpc].cpu().view(torch.int16), src[layer].view(torch.int16))
                   for layer, dst in enumerate(self.layers))  # bits, not values: NaN != NaN


@dataclass
class _Pair:
    """The holder and fetcher sidecars with their engine clients on the rows."""

    pool: LocalPool
    holder: EngineClient
    fetcher: EngineClient


@contextlib.contextmanager
def _pair(geometry: Geometry, chunks: int, host: HostRows, settings: PeerSettings,
          lanes: int | None, cpus: tuple[list[int], list[int]]) -> Iterator[_Pair]:
    capacity = (chunks + 2) * geometry.row_stride
    extra = ("--lanes", str(lanes)) if lanes is not None else ()
    transport = settings.plane
    certs = tempfile.TemporaryDirectory(prefix="kv-offload-bench-gpu-tls-")
    if settings.plane == "tls":
        files = pool_certificates(certs.name, ["pool"])["pool"]
        transport, extra = "tcp", (*extra, "--tls-cert-file", files.cert_file, "--tls-key-file",
                                   files.key_file, "--tls-ca-file", files.ca_file)
    pool = LocalPool(0, transport=transport, config=geometry.pool, capacity_bytes=capacity,
                     fetch_deadline_seconds=settings.timeout_s, publish_interval_seconds=0.1,
                     extra_args=extra, log_level="WARNING", workdir=None)
    clients: list[EngineClient] = []
    try:
        pool.start()
        for identity, on in zip(("holder", "fetcher"), cpus):
            with started_on(on):
                pool.add(identity=identity)
        for identity in ("holder", "fetcher"):
            client = EngineClient.connect("127.0.0.1", pool[identity].port, timeout=settings.timeout_s,
                                          region=host.spec)
            clients.append(client)
            if not client.region_attached:
                raise RuntimeError(f"the {identity} did not attach the rows: {client.region_reason}")
        yield _Pair(pool, clients[0], clients[1])
    finally:
        for client in clients:
            client.close()
        pool.stop()
        certs.cleanup()


def memcpy_seconds(host: HostRows, count: int) -> float:
    """Seconds one thread of this process takes to copy the chunk bytes of rows 0..count-1
    (into a reused buffer of ``MEMCPY_PIECE_BYTES``, past the caches): a store's reference."""
    piece = np.zeros(MEMCPY_PIECE_BYTES, dtype=np.uint8)
    piece[:] = 1  # every page faulted in before the clock starts
    rows_per_piece = max(1, MEMCPY_PIECE_BYTES // host.chunk_bytes)
    t0 = time.perf_counter()
    for start in range(0, count, rows_per_piece):
        for j, r in enumerate(range(start, min(count, start + rows_per_piece))):
            off = (j * host.chunk_bytes) % MEMCPY_PIECE_BYTES
            np.copyto(piece[off:off + host.chunk_bytes], host.chunk(r))
    return time.perf_counter() - t0


def _store(pair: _Pair, keys: Sequence[bytes], geometry: Geometry, timeout_s: float) -> tuple[float, float]:
    """Store ``keys`` (rows 0..) into the holder as the tier beside an engine on a GPU sends
    them (``engine_platform.paces_stores``: not paced); seconds until they landed in the
    holder, and until the fetcher sees them all."""
    batch = max(1, STORE_BATCH_BYTES // geometry.chunk_bytes)
    paced = paces_stores(ENGINE_DEVICE_TYPE)
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        rows = list(range(i, min(i + batch, len(keys))))
        stored = pair.holder.store_rows(keys[i:i + len(rows)], rows, strict=True, paced=paced)
        if stored != len(rows):
            raise RuntimeError(f"the holder stored {stored} of {len(rows)} chunks (rows {rows[0]}..)")
    landed_s = time.perf_counter() - t0
    fetcher = pair.pool["fetcher"]
    deadline = time.monotonic() + min(timeout_s, VISIBLE_TIMEOUT_S)
    while fetcher.held(keys) != (0, len(keys)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fetcher does not see the {len(keys)} stored chunks at its peer: "
                               f"{fetcher.held(keys)}")
        time.sleep(0.005)
    return landed_s, time.perf_counter() - t0


def _hit(pair: _Pair, keys: Sequence[bytes], host: HostRows, kv: DeviceKV, digests: Sequence[int],
         settings: PeerSettings, check_device: bool) -> dict[str, Any]:
    """One peer hit of ``keys`` (rows 0..): its phases, CPU and whether the bytes landed."""
    n = len(keys)
    pids = {role: pair.pool[role].proc.pid for role in ("holder", "fetcher")}  # type: ignore[union-attr]
    first0 = _first_chunk_samples(pair)
    cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
    with HealthPolls(pair.pool["fetcher"].port) as polls:
        t0 = time.perf_counter()
        reply = pair.fetcher.lookup(keys, timeout=settings.timeout_s)
        t1 = time.perf_counter()
        loaded = pair.fetcher.load_rows(keys, list(range(n)), timeout=settings.timeout_s)
        t2 = time.perf_counter()
    cpu1 = {role: cpu_seconds(pid) for role, pid in pids.items()}
    first1 = _first_chunk_samples(pair)
    kv.copy_in(host, loaded)
    t3 = time.perf_counter()
    identical = loaded == n and host.matches(digests[:n])
    if identical and check_device:
        identical = kv.holds_row(host, 0) and kv.holds_row(host, n - 1)
    gb = n * kv.g.chunk_bytes / 1e9
    fetches = first1[1] - first0[1]
    out = {"lookup_s": t1 - t0, "fetch_s": t2 - t1, "h2d_s": t3 - t2, "hit_s": t3 - t0,
           # the fetcher's time from its first chunk request (sent with the lookup) to that chunk
           # verified, the hit's fixed cost before bytes move (mean over its fetches; None: none)
           "first_chunk_s": (first1[0] - first0[0]) / fetches if fetches > 0 else None,
           "found_local": reply.local, "found_peer": reply.peer, "loaded": loaded,
           "identical": identical,
           "holder_cpu_s_per_gb": (cpu1["holder"] - cpu0["holder"]) / gb,
           "fetcher_cpu_s_per_gb": (cpu1["fetcher"] - cpu0["fetcher"]) / gb,
           "healthz_polls": len(polls.seconds), "healthz_p99_ms": polls.p99_ms()}
    host.zero(n)
    return out


def _first_chunk_samples(pair: _Pair) -> tuple[float, float]:
    """The fetcher's ``kv_offload_peer_fetch_first_chunk_seconds`` (sum, count) now."""
    fetcher = pair.pool["fetcher"]
    return (fetcher.metric("kv_offload_peer_fetch_first_chunk_seconds_sum"),
            fetcher.metric("kv_offload_peer_fetch_first_chunk_seconds_count"))


def _median_run(runs: list[dict[str, Any]], kv_bytes: int) -> dict[str, Any]:
    """The run whose hit time is the median (lower middle), with every run's times and rates."""
    middle = sorted(runs, key=lambda r: r["hit_s"])[(len(runs) - 1) // 2]
    return {**middle, "fetch_gbps": kv_bytes / (middle["lookup_s"] + middle["fetch_s"]) / 1e9,
            "hit_gbps": kv_bytes / middle["hit_s"] / 1e9,
            "hit_runs_s": [r["hit_s"] for r in runs],
            "identical": all(r["identical"] for r in runs),
            "all_loaded": all(r["loaded"] == r["chunks"] for r in runs),
            # the worst run's: a probe may come during any of them
            "healthz_p99_ms": max((r["healthz_p99_ms"] for r in runs if r["healthz_p99_ms"] is not None),
                                  default=None)}


def lanes_in_use(status: Any, peer: str = "holder") -> int | None:
    """The lanes a fetcher's ``/v1/status`` says it runs to ``peer`` (``data_lanes``), or None
    where it says nothing (a sidecar without lanes)."""
    lanes = status.get("data_lanes") if isinstance(status, dict) else None
    value = lanes.get(peer) if isinstance(lanes, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def measure_peer_hits(geometry: Geometry, lengths: Sequence[int], lanes: int | None,
                      settings: PeerSettings, dev: str, *,
                      cpus: tuple[list[int], list[int]] | None = None,
                      progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Peer hits of each prompt length with one lane setting: ``{"lanes", "store", "hits": {tokens: ...}}``;
    ``cpus``: the (holder's, fetcher's) CPUs, by default each half of this process's."""
    lengths = sorted(lengths)
    chunks = geometry.chunks(lengths[-1])
    cpus = cpus or split_cpus(os.sched_getaffinity(0))
    keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(chunks)]
    host = HostRows(settings.shm_dir, chunks, geometry.row_stride, geometry.chunk_bytes, dev)
    kv = None
    try:
        kv = DeviceKV(geometry, chunks, dev)
        digests = host.fill(chunks)
        label = "default" if lanes is None else lanes
        memcpy_s = memcpy_seconds(host, chunks)
        with _pair(geometry, chunks, host, settings, lanes, cpus) as pair:
            landed_s, store_s = _store(pair, keys, geometry, settings.timeout_s)
            host.zero(chunks)
            progress(f"{geometry.name} lanes {label}, holder on CPUs {cpu_list(cpus[0])}, fetcher on "
                     f"{cpu_list(cpus[1])}: stored {chunks} chunks "
                     f"({chunks * geometry.chunk_bytes / 2**20:.0f} MiB) in the holder in {landed_s:.3f} s "
                     f"({landed_s / memcpy_s:.2f}x a memcpy of its bytes, {memcpy_s:.3f} s), visible to the "
                     f"fetcher after {store_s:.3f} s")
            warm = geometry.chunks(lengths[0])  # enough chunks to open every lane's connection
            _hit(pair, keys[:warm], host, kv, digests, settings, check_device=False)
            hits: dict[int, dict[str, Any]] = {}
            for tokens in lengths:
                n = geometry.chunks(tokens)
                runs = []
                for r in range(settings.repeats):
                    run = _hit(pair, keys[:n], host, kv, digests, settings, check_device=r == 0)
                    runs.append({**run, "chunks": n})
                hit = _median_run(runs, n * geometry.chunk_bytes)
                hits[tokens] = hit
                first = "-" if hit["first_chunk_s"] is None else f"{hit['first_chunk_s'] * 1e3:.1f}"
                progress(f"{geometry.name} lanes {label} {tokens:>6} tokens: hit {hit['hit_s'] * 1e3:8.1f} ms "
                         f"(lookup {hit['lookup_s'] * 1e3:.1f}, first chunk {first}, fetch {hit['fetch_s'] * 1e3:.1f}, "
                         f"h2d {hit['h2d_s'] * 1e3:.1f}) {hit['fetch_gbps']:.2f} GB/s, CPU s/GB holder "
                         f"{hit['holder_cpu_s_per_gb']:.2f} fetcher {hit['fetcher_cpu_s_per_gb']:.2f}"
                         f"{'' if hit['identical'] else '  BYTES DIFFER'}"
                         f"{'' if hit['all_loaded'] else '  MISSED'}")
            fetcher_status = pair.pool["fetcher"].status()
            in_use = lanes_in_use(fetcher_status)
            raw = raw_tcp(lanes or in_use or 1, min(chunks * geometry.chunk_bytes, RAW_TCP_MAX_BYTES),
                          settings.repeats, *cpus)
            progress(f"raw TCP, {raw['streams']} streams, same pinning: {raw['gbps']:.2f} GB/s, CPU s/GB "
                     f"sender {raw['sender_cpu_s_per_gb']:.2f} receiver {raw['receiver_cpu_s_per_gb']:.2f}")
        return {"raw_tcp": raw, "lanes": label, "store_s": store_s,
                "store_gbps": chunks * geometry.chunk_bytes / store_s / 1e9,
                "store_landed_s": landed_s, "store_memcpy_s": memcpy_s, "store_bytes": chunks * geometry.chunk_bytes,
                "store_paced": paces_stores(ENGINE_DEVICE_TYPE),
                "holder_cpus": cpu_list(cpus[0]), "fetcher_cpus": cpu_list(cpus[1]),
                "lanes_in_use": in_use, "data_scheme": str(fetcher_status.get("data_address", "")).split("://")[0],
                "hits": hits}
    finally:
        del kv
        host.close()
        if dev == "cuda":
            import torch

            torch.cuda.empty_cache()
