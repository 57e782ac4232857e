"""Raw sockets of ``kv-offload bench attack``: hostile connections to loopback only.

``Siege``: one thread holding many connections open at once (silent, dripping
header bytes, or stalled one byte before the end of an announced body/frame),
reading whatever the sidecar answers and noting when it cuts each one; the words
``describe`` gives an answer. One-shot requests are ``exchange``.

Every connection goes to 127.0.0.1 from a source address 127.0.0.2 ... (strangers come
from other addresses than the pool's own members); ``require_loopback`` refuses any
other target.
"""

from __future__ import annotations

import collections
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_offload_sidecar.data import protocol as proto

# Bytes of a reply kept per held connection (enough for a status line or a few frames).
KEEP_BYTES = 4096
# Seconds a connect may take before it counts as refused.
CONNECT_TIMEOUT = 3.0
# Shared zero bytes the stalled bodies and frames are cut from (no copy per connection).
ZEROS = memoryview(bytes(2 << 20))


def require_loopback(host: str) -> str:
    """``host`` when it is an IPv4 loopback address; ValueError otherwise (never a real network)."""
    if not host.startswith("127."):
        raise ValueError(f"kv-offload bench attack only targets 127.0.0.0/8, not {host!r}")
    return host


def sources(n: int) -> list[str]:
    """Source addresses 127.0.0.2 ... 127.0.0.(n+1) the attackers bind to."""
    if not 1 <= n <= 200:
        raise ValueError(f"sources={n} must be in 1..200 (127.0.0.254 is the bench's own new pod)")
    return [f"127.0.0.{2 + i}" for i in range(n)]


def connect(host: str, port: int, source: str, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect((require_loopback(host), port))
    except BaseException:
        sock.close()
        raise
    return sock


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://h:p``, ``nixl://h:p`` or ``h:p``."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    return require_loopback(host.strip("[]")), int(port)


# ---------------------------------------------------------------- answers


def http_status(data: bytes) -> int | None:
    """Status code of an HTTP response's first line, None when there is none."""
    if not data.startswith(b"HTTP/"):
        return None
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def frame_names(data: bytes) -> list[str]:
    """Types of the complete data-plane frames in ``data`` (ERROR frames with their reason)."""
    names = []
    pos = 0
    while pos + proto.HEADER_BYTES <= len(data):
        try:
            magic, _major, mtype, _rid, length = proto.HEADER.unpack_from(data, pos)
        except struct.error:
            break
        if magic != proto.MAGIC:
            names.append("garbage")
            break
        try:
            name = proto.MessageType(mtype).name
        except ValueError:
            name = f"type{mtype}"
        payload = data[pos + proto.HEADER_BYTES:pos + proto.HEADER_BYTES + min(length, 256)]
        if name == "ERROR":
            name = f"ERROR({payload.split(b':', 1)[0].decode('utf-8', 'replace')[:32]})"
        names.append(name)
        pos += proto.HEADER_BYTES + length
    return names


def describe(kind: str, data: bytes) -> str:
    """One word for what a connection of ``kind`` ("http", "data") received."""
    if not data:
        return "nothing"
    if kind == "http":
        status = http_status(data)
        return f"HTTP {status}" if status is not None else "non-HTTP bytes"
    names = frame_names(data)
    return "+".join(names) if names else "partial frame"


# ---------------------------------------------------------------- held connections


@dataclass
class Held:
    """One hostile connection the siege holds."""

    # Attack class it belongs to.
    cls: str
    # "http" or "data": how its answer is read.
    kind: str
    sock: socket.socket | None
    # Monotonic time it connected.
    opened: float
    # Bytes still to send (views of shared buffers).
    out: collections.deque = field(default_factory=collections.deque)
    # Bytes sent one at a time, one every ``drip_every`` seconds, after ``out``.
    drip: bytes = b""
    drip_every: float = 1.0
    next_drip: float = 0.0
    # What the sidecar sent (the first KEEP_BYTES).
    received: bytearray = field(default_factory=bytearray)
    # Monotonic time the sidecar closed or reset it (None while open).
    cut_at: float | None = None


@dataclass
class ClassPlan:
    """How one class of held connections is opened."""

    name: str
    # "control" or "data": the port it targets.
    port_name: str
    kind: str
    port: int
    count: int
    # Bytes sent right after connecting (a list of buffers).
    first: Sequence[bytes | memoryview] = ()
    # Then one byte of this every ``drip_every`` seconds.
    drip: bytes = b""
    drip_every: float = 1.0


@dataclass
class ClassOutcome:
    """What the sidecar did to one class of held connections."""

    name: str
    port_name: str
    connections: int = 0
    connect_failed: int = 0
    # Monotonic times the class began and finished opening.
    opened_from: float = 0.0
    opened_to: float = 0.0
    answers: dict[str, int] = field(default_factory=dict)
    # Connections the sidecar closed while the siege held them.
    cut: int = 0
    # Seconds from connect to cut, of the cut ones.
    cut_seconds: list[float] = field(default_factory=list)


class Siege(threading.Thread):
    """Open every class of ``plans`` in turn (from ``source`` addresses), keep them all open
    for ``hold_seconds`` after the last one, then close them; one thread, one selector."""

    def __init__(self, host: str, plans: Sequence[ClassPlan], source_addresses: Sequence[str],
                 hold_seconds: float, progress=None, on_class=None, class_seconds: float = 1.0) -> None:
        super().__init__(name="kvo-attack-siege", daemon=True)
        self.host = require_loopback(host)
        self.plans = list(plans)
        self.sources = list(source_addresses)
        self.hold_seconds = hold_seconds
        self.progress = progress or (lambda line: None)
        # Called with a class's name once it is open and has been served ``class_seconds``.
        self.on_class = on_class or (lambda name: None)
        self.class_seconds = class_seconds
        self.sel = selectors.DefaultSelector()
        self.held: list[Held] = []
        self.outcomes = {p.name: ClassOutcome(p.name, p.port_name) for p in self.plans}
        # Monotonic times: every connection open / all closed by the siege.
        self.all_open_at = 0.0
        self.closed_at = 0.0
        # Connections open right now (read by the sampler thread).
        self.open_now = 0
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    # ---- the loop ---------------------------------------------------------------

    def run(self) -> None:
        try:
            n = 0
            for plan in self.plans:
                out = self.outcomes[plan.name]
                out.opened_from = time.monotonic()
                for _ in range(plan.count):
                    if self._halt.is_set():
                        break
                    self._open(plan, self.sources[n % len(self.sources)])
                    n += 1
                    if n % 25 == 0:
                        self._service(0.0)
                out.opened_to = time.monotonic()
                settle = time.monotonic() + self.class_seconds
                while time.monotonic() < settle:
                    self._service(0.1)
                self.on_class(plan.name)
                self.progress(f"  siege: {plan.name} opened {out.connections} of {plan.count} "
                              f"({out.connect_failed} refused), {self.open_now} hostile connections open")
            self.all_open_at = time.monotonic()
            end = self.all_open_at + self.hold_seconds
            while not self._halt.is_set() and time.monotonic() < end and self.open_now:
                self._service(0.2)  # (until the sidecar has cut every one of them)
        finally:
            self._close_all()

    def _open(self, plan: ClassPlan, source: str) -> None:
        out = self.outcomes[plan.name]
        try:
            sock = connect(self.host, plan.port, source)
        except OSError:
            out.connect_failed += 1
            return
        sock.setblocking(False)
        now = time.monotonic()
        held = Held(plan.name, plan.kind, sock, now, collections.deque(memoryview(b) for b in plan.first),
                    plan.drip, plan.drip_every, now + plan.drip_every)
        out.connections += 1
        self.held.append(held)
        self.open_now += 1
        self.sel.register(sock, self._events(held), held)

    @staticmethod
    def _events(h: Held) -> int:
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if h.out else 0)

    def _service(self, timeout: float) -> None:
        now = time.monotonic()
        for h in self.held:
            if h.sock is not None and h.drip and not h.out and now >= h.next_drip:
                h.out.append(memoryview(h.drip[:1]))
                h.drip = h.drip[1:]
                h.next_drip = now + h.drip_every
                self.sel.modify(h.sock, self._events(h), h)
        for key, events in self.sel.select(timeout):
            h: Held = key.data
            if h.sock is None:
                continue
            if events & selectors.EVENT_READ:
                self._read(h)
            if h.sock is not None and events & selectors.EVENT_WRITE:
                self._write(h)

    def _read(self, h: Held) -> None:
        try:
            data = h.sock.recv(65536)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._cut(h)
            return
        room = KEEP_BYTES - len(h.received)
        if room > 0:
            h.received += data[:room]

    def _write(self, h: Held) -> None:
        while h.out:
            buf = h.out[0]
            try:
                n = h.sock.send(buf)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._cut(h)
                return
            if n < len(buf):
                h.out[0] = buf[n:]
                return
            h.out.popleft()
        self.sel.modify(h.sock, self._events(h), h)  # type: ignore[arg-type]

    def _cut(self, h: Held) -> None:
        h.cut_at = time.monotonic()
        out = self.outcomes[h.cls]
        out.cut += 1
        out.cut_seconds.append(h.cut_at - h.opened)
        self._drop(h)

    def _drop(self, h: Held) -> None:
        if h.sock is None:
            return
        self.sel.unregister(h.sock)
        h.sock.close()
        h.sock = None
        self.open_now -= 1

    def _close_all(self) -> None:
        for h in self.held:
            if h.sock is not None:
                # Anything already answered is read before the close.
                try:
                    data = h.sock.recv(65536)
                    if data and len(h.received) < KEEP_BYTES:
                        h.received += data[:KEEP_BYTES - len(h.received)]
                except OSError:
                    pass
                self._drop(h)
        self.closed_at = time.monotonic()
        for h in self.held:
            answers = self.outcomes[h.cls].answers
            word = describe(h.kind, bytes(h.received))
            answers[word] = answers.get(word, 0) + 1
        self.sel.close()
