"""The siege of ``kv-offload bench attack``: up to 1,000 hostile connections held at once.

Five classes are opened one after the other against the target member and
then all held together for ``hold_seconds``:

- ``control flood``: connections to the control port that never send a byte;
- ``slow headers``: a request line, then one header byte a second, never the end;
- ``slow body``: a handshake POST announcing the largest body the port takes,
  sent but for its last bytes, then one byte a second, never the last one;
- ``auth frame 1 MiB``: a frame header announcing a 1 MiB AUTH_RESPONSE, its
  payload sent but for the last bytes (the issue: 300 of these held 258 MiB);
- ``slow auth frame``: a real-sized AUTH_RESPONSE header, its 50 bytes sent one a
  second, never the last (the deadline must be the whole proof's, not an idle one);
- ``data flood``: connections to the data port that never answer the challenge.

The costly classes open first, so the floods meet the sidecar's connection limits
with them held. Each class gets a row (what came back, how many the sidecar cut
and how soon, the target's RSS and descriptors as that class was added); the
siege as a whole gets one more (counters, logs and tracebacks of the whole), and
once everything is open the pool's own callers try the target's control port
from 127.0.0.1 (a member's handshake, an admin's ``/v1/status``, a ``/metrics``
scrape) and the members' connections are checked: what a legitimate caller pays.
"""

from __future__ import annotations

import statistics
import time

from kv_offload_sidecar.data import protocol as proto
from kv_offload_sidecar.peers import handshake

from kv_offload_tools.bench.attack.context import AttackContext, AttackResult, measured
from kv_offload_tools.bench.attack.control import legitimate_calls
from kv_offload_tools.bench.attack.sockets import ZEROS, ClassPlan, Siege, split_address

# Share of the siege's connections per class, in the order they are opened: the costly
# ones first (so they are let in before the floods fill the sidecar's connection limits).
SHARES = (("slow body", 0.15), ("slow headers", 0.15), ("auth frame 1 MiB", 0.20),
          ("slow auth frame", 0.10), ("control flood", 0.30), ("data flood", 0.10))
# Body bytes the slow bodies announce: the largest handshake body the sidecar takes (the
# issue's 256 KiB when it names none).
SLOW_BODY_BYTES = getattr(handshake, "MAX_HANDSHAKE_BODY_BYTES", 256 * 1024)
# Bytes of an announced body or frame left for the drip (the last one is never sent).
DRIP_TAIL = 32
# Bytes of a real AUTH_RESPONSE payload (u16 length, 16-byte session id, 32-byte proof): the
# slow auth frames announce one and send it a byte a second, never the last.
AUTH_RESPONSE_BYTES = 2 + 16 + proto.PROOF_BYTES
# Seconds each class is served after it opened before the next one opens.
CLASS_SECONDS = 0.5


def siege_plans(ctx: AttackContext, connections: int) -> list[ClassPlan]:
    counts = {name: max(1, round(connections * share)) for name, share in SHARES}
    ucx = ctx.data_address.startswith("ucx://")
    data_port = 0 if ucx else split_address(ctx.data_address)[1]
    head = (f"POST /v1/handshake HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {SLOW_BODY_BYTES}\r\n\r\n").encode()
    auth = proto.HEADER.pack(proto.MAGIC, proto.WIRE_MAJOR, proto.MessageType.AUTH_RESPONSE, 0, 1 << 20)
    small_auth = proto.HEADER.pack(proto.MAGIC, proto.WIRE_MAJOR, proto.MessageType.AUTH_RESPONSE, 0,
                                   AUTH_RESPONSE_BYTES)
    control = {
        "control flood": ClassPlan("control flood", "control", "http", ctx.port, counts["control flood"]),
        "slow headers": ClassPlan("slow headers", "control", "http", ctx.port, counts["slow headers"],
                                  first=[b"POST /v1/handshake HTTP/1.1\r\nHost: 127.0.0.1\r\n"],
                                  drip=b"X-Slow-Header: " + b"s" * 200),
        "slow body": ClassPlan("slow body", "control", "http", ctx.port, counts["slow body"],
                               first=[head, ZEROS[:SLOW_BODY_BYTES - DRIP_TAIL]], drip=b" " * (DRIP_TAIL - 1)),
    }
    data = {
        "data flood": ClassPlan("data flood", "data", "data", data_port, counts["data flood"]),
        "auth frame 1 MiB": ClassPlan("auth frame 1 MiB", "data", "data", data_port, counts["auth frame 1 MiB"],
                                      first=[auth, ZEROS[:(1 << 20) - DRIP_TAIL]], drip=bytes(DRIP_TAIL - 1)),
        "slow auth frame": ClassPlan("slow auth frame", "data", "data", data_port, counts["slow auth frame"],
                                     first=[small_auth], drip=bytes(AUTH_RESPONSE_BYTES - 1)),
    }
    if ucx:
        data = {}  # a stranger cannot reach a UCX worker address (module docstring of attack_wire)
    return [{**control, **data}[name] for name, _ in SHARES if name in {**control, **data}]


def run_siege(ctx: AttackContext, connections: int, hold_seconds: float) -> None:
    plans = siege_plans(ctx, connections)
    total = sum(p.count for p in plans)
    ident = ctx.target.identity
    # RSS and descriptors of the target before the siege and once each class is open.
    steps: dict[str, tuple[int, int, int]] = {"": ctx.watch.sample().members[ident]}
    siege = Siege(ctx.host, plans, ctx.sources, hold_seconds, ctx.progress,
                  on_class=lambda name: steps.__setitem__(name, ctx.watch.sample().members[ident]),
                  class_seconds=CLASS_SECONDS)
    ctx.watch.gauges["hostile connections open"] = lambda: siege.open_now
    rows: list[AttackResult] = []
    ports = "+".join(sorted({p.port_name for p in plans}))
    ctx.siege_connections = total
    with measured(ctx, f"siege: {total} connections held", ports) as whole:
        whole.sent = total
        siege.start()
        while siege.is_alive() and not siege.all_open_at:
            siege.join(0.2)
        if siege.is_alive():  # everything is open: what do the pool's own callers get now?
            ctx.during_siege = legitimate_calls(ctx)
            wrong = {k: v for k, v in ctx.watch.connected(timeout=0).items() if v}
            ctx.during_siege["members connected"] = ("every member connected" if not wrong else
                                                     "; ".join(f"{k} {v}" for k, v in wrong.items()))
            for what, answer in ctx.during_siege.items():
                whole.note(f"while all were held, {what}: {answer}")
        siege.join()
        ctx.watch.sample()
        rows = _class_rows(ctx, siege, plans, steps)
        for r in rows:
            whole.http_500 += r.http_500
            whole.http_5xx_other += r.http_5xx_other
        whole.cut = sum(r.cut or 0 for r in rows)
    ctx.results.extend(rows)
    ctx.progress(f"  siege closed at {time.strftime('%H:%M:%S')}: the sidecar cut {whole.cut} of {total}")


def _class_rows(ctx: AttackContext, siege: Siege, plans: list[ClassPlan],
                steps: dict[str, tuple[int, int, int]]) -> list[AttackResult]:
    """One row per class; its RSS and descriptors are what the target added as it opened
    (read once the class had been served a second, the classes before it still held)."""
    rows = []
    previous = steps[""]
    for plan in plans:
        out = siege.outcomes[plan.name]
        now = steps.get(plan.name, previous)
        r = AttackResult(f"  {plan.name}", plan.port_name, sent=out.connections, cut=out.cut,
                         started=out.opened_from, ended=siege.closed_at)
        for word, n in out.answers.items():
            for _ in range(n):
                r.answer(word, int(word.split()[1]) if word.startswith("HTTP ") else None)
        if out.connect_failed:
            r.answers["connect refused"] = out.connect_failed
        if out.cut_seconds:
            r.cut_median_seconds = round(statistics.median(out.cut_seconds), 2)
        r.rss_peak_growth, r.fds_peak_growth = now[0] - previous[0], now[1] - previous[1]
        previous = now
        r.honest = ctx.honest.stats(out.opened_from, siege.closed_at)
        rows.append(r)
    return rows
