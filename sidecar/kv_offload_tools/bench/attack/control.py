"""One-shot attacks on the control port (HTTP) of ``kv-offload bench attack``.

Each sends ``ctx.repeats`` requests (from rotating stranger source addresses)
and records every answer: oversized request lines, headers and bearer tokens;
deeply nested JSON and 5000-digit integers in handshake (and session-only)
bodies; a 200 kB malformed ``step``; a flood of rejected step-1 handshakes; a
step 1 of another wire version, compared byte for byte with a stranger's step 1
of this version (nothing may be said before the proof); replayed steps of a
member's real handshake transcript (both must be refused); and a flood of step 1s
carrying the pool's real key id (which anyone on the pod network can read) while a
member keeps handshaking.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error

from kv_offload_sidecar.peers.handshake import (
    WIRE_VERSION,
    HandshakeError,
    HandshakeInitiator,
    Session,
    make_hello,
)
from kv_offload_sidecar.peers.pool_keys import key_id

from kv_offload_tools.bench.attack.context import AttackContext, AttackResult, measured
from kv_offload_tools.bench.attack.exchange import Answer, data_authenticate, http_exchange, http_request

HANDSHAKE = "/v1/handshake"
# The status of a handshake over its source's rate (control/limits.py's token bucket).
RATE_LIMITED = 429
# Seconds the flood of step 1s with a sniffed key id lasts at most (a rate-limited source is
# answered once a second per connection, so the count alone would not end it).
FLOOD_SECONDS = 15.0
# Source address of a legitimate caller that never proved anything (a new pod, Prometheus, an
# admin's laptop): outside the attackers' 127.0.0.2 ... range.
NEW_POD_SOURCE = "127.0.0.254"


def _send(ctx: AttackContext, result: AttackResult, request: bytes, i: int, label: str = "") -> Answer:
    answer = http_exchange(ctx.host, ctx.port, request, ctx.source(i))
    result.sent += 1
    result.answer(f"{label}{answer.word}", answer.status)
    server = _header(answer.data, b"server")
    if server:
        ctx.server_headers.add(server)
    return answer


def _header(data: bytes, name: bytes) -> str:
    head = data.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip().decode("latin-1")[:80]
    return ""


def stranger_step1(ctx: AttackContext, wire_version: str = WIRE_VERSION) -> dict:
    """A step-1 body of someone without the pool key (a random key's id)."""
    body = HandshakeInitiator(os.urandom(32), ctx.pool.local_hello(identity="stranger")).step1()
    body["wire_version"] = wire_version
    return body


def public_metrics(ctx: AttackContext) -> None:
    """What ``/metrics`` tells a stranger about the pool: the labels of kv_offload_config_info
    and whether the model, dtype, fingerprint or wire version appear anywhere."""
    with measured(ctx, "public /metrics", "control") as result:
        answer = _send(ctx, result, http_request("GET", "/metrics"), 0)
        body = answer.data.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")
        info = [line for line in body.splitlines() if line.startswith("kv_offload_config_info{")]
        labels = sorted({part.split("=", 1)[0] for line in info
                         for part in line.split("{", 1)[1].rsplit("}", 1)[0].split(",") if "=" in part})
        result.note(f"kv_offload_config_info labels a stranger reads: {', '.join(labels) or 'none'}")
        told = [name for name, value in (("model", ctx.pool.config.model.name),
                                         ("fingerprint", ctx.pool.config.fingerprint),
                                         ("wire version", f'"{WIRE_VERSION}"')) if value in body]
        result.note(f"values told to anyone: {', '.join(told) or 'none of model, fingerprint, wire version'}")


def oversized_http(ctx: AttackContext) -> None:
    """70 kB request line, 70 kB header, 300 headers, 9 kB bearer token: each its own row."""
    cases = [
        ("request line 70 kB", lambda: http_request("GET", "/healthz?" + "a" * 70_000)),
        ("header 70 kB", lambda: http_request("GET", "/healthz", headers=[("X-Pad", "b" * 70_000)])),
        ("300 headers", lambda: http_request("GET", "/healthz",
                                             headers=[(f"X-H{i}", "v") for i in range(300)])),
        ("bearer token 9 kB", lambda: http_request("GET", "/v1/status",
                                                   headers=[("Authorization", "Bearer " + "c" * 9_000)])),
    ]
    for name, build in cases:
        with measured(ctx, name, "control") as result:
            for i in ctx.rounds(ctx.repeats, result):
                _send(ctx, result, build(), i)


def deep_json(ctx: AttackContext) -> None:
    """Deep nesting in a handshake body (small enough for any body limit, and not), in a
    step-1 field and in session-only bodies."""
    step1 = json.dumps(stranger_step1(ctx))
    bodies = [(HANDSHAKE, f"{depth} deep: ", "[" * depth + "]" * depth) for depth in (2_000, 12_000, 100_000)]
    bodies += [
        (HANDSHAKE, "in wire_version: ", step1.replace(f'"{WIRE_VERSION}"', "[" * 5_000 + "]" * 5_000, 1)),
        (HANDSHAKE, "object nesting: ", '{"a":' * 4_000 + "1" + "}" * 4_000),
        ("/v1/publish", "publish: ", "[" * 12_000 + "]" * 12_000),
        ("/v1/locate", "locate: ", "[" * 12_000 + "]" * 12_000),
        ("/v1/lookup", "lookup (no token): ", "[" * 12_000 + "]" * 12_000),
    ]
    with measured(ctx, "deeply nested JSON", "control") as result:
        for i in ctx.rounds(ctx.repeats, result):
            for path, label, body in bodies:
                _send(ctx, result, http_request("POST", path, body.encode()), i, label)


def huge_integers(ctx: AttackContext) -> None:
    """5000-digit integers in each field of a step-1 body (and a 5000-digit float)."""
    digits = "9" * 5000
    with measured(ctx, "5000-digit integers", "control") as result:
        for i in ctx.rounds(ctx.repeats, result):
            for field in ("wire_version", "nonce", "key_ids", "step"):
                body = json.dumps(stranger_step1(ctx))
                body = body.replace(f'"{field}": ', f'"{field}": {digits}, "_{field}": ', 1)
                _send(ctx, result, http_request("POST", HANDSHAKE, body.encode()), i, f"in {field}: ")
            body = f'{{"step": "hello", "wire_version": 1{digits}.5e{digits}}}'
            _send(ctx, result, http_request("POST", HANDSHAKE, body.encode()), i, "float: ")


def malformed_step(ctx: AttackContext) -> None:
    """A long ``step`` value, 200 kB and 30 kB (within a small handshake body limit): the
    issue saw twenty 200 kB ones add 3.9 MB of log."""
    with measured(ctx, "malformed step 30-200 kB", "control") as result:
        for i in ctx.rounds(ctx.repeats, result):
            for size in (30_000, 200_000):
                body = json.dumps({"step": "x" * size, "wire_version": WIRE_VERSION}).encode()
                _send(ctx, result, http_request("POST", HANDSHAKE, body), i, f"{size // 1000} kB: ")


def rejected_flood(ctx: AttackContext) -> None:
    """Many strangers' step 1s, each refused: the log must not grow by a line per request."""
    with measured(ctx, "rejected handshake flood", "control") as result:
        for i in ctx.rounds(ctx.rejected_handshakes, result):
            _send(ctx, result, http_request("POST", HANDSHAKE, json.dumps(stranger_step1(ctx)).encode()), i)


def other_wire_version(ctx: AttackContext) -> bool:
    """Strangers' step 1 of other wire versions against one of this version: the same answer
    (status and body) whatever the version, and no version in it. Returns True when it leaked.
    A pair where either step 1 was rate limited (429: the source's handshake budget, which
    reads no body) is not compared, and counted."""
    major = int(WIRE_VERSION.split(".")[0])
    leaked = False
    compared = limited = 0
    with measured(ctx, "other wire version", "control") as result:
        for i in ctx.rounds(ctx.repeats, result):
            same = _send(ctx, result, http_request("POST", HANDSHAKE, json.dumps(stranger_step1(ctx)).encode()),
                         i, f"wire {WIRE_VERSION}: ")
            for version in (f"{major + 1}.0", f"{major - 1}.9", "99.0"):
                other = _send(ctx, result, http_request(
                    "POST", HANDSHAKE, json.dumps(stranger_step1(ctx, version)).encode()), i, f"wire {version}: ")
                body_same = same.data.partition(b"\r\n\r\n")[2]
                body_other = other.data.partition(b"\r\n\r\n")[2]
                if b"wire_version" in body_other:
                    leaked = True
                if RATE_LIMITED in (same.status, other.status):
                    limited += 1
                    continue
                compared += 1
                if other.status != same.status or body_other != body_same or b"wire_version" in body_other:
                    leaked = True
                    result.note(f"wire {version} answered {other.status} {body_other[:160]!r} where wire "
                                f"{WIRE_VERSION} got {same.status} {body_same[:80]!r}")
        result.note(f"{compared} pairs compared, {limited} set aside (a step 1 rate limited)")
        if not compared:
            leaked = True  # nothing was compared: no verdict of "not told"
        result.note("the answer says nothing before the proof" if not leaked
                    else "the version is answered before the proof (or nothing was compared)")
    return leaked


def sniffed_key_id_flood(ctx: AttackContext, count: int, threads: int = 4) -> None:
    """Step 1s carrying the pool's real key id (a passive observer of the pod network sees it:
    the control port is plain HTTP) but no key: each is answered with a server nonce the
    sidecar keeps pending until it expires, until the source's handshake budget is spent
    (then 429, a second later). ``count`` at most, for ``FLOOD_SECONDS`` at most. Meanwhile a
    member handshakes every second."""
    kid = key_id(ctx.pool.pool_key).hex()
    statuses: list[int | None] = []
    lock = threading.Lock()
    stop_at = min(ctx.deadline, time.monotonic() + FLOOD_SECONDS)

    def flood(worker: int) -> None:
        conn: http.client.HTTPConnection | None = None
        for i in range(worker, count, threads):
            if time.monotonic() > stop_at:
                break
            body = json.dumps({**stranger_step1(ctx), "key_ids": [kid]})
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(ctx.host, ctx.port, timeout=5,
                                                      source_address=(ctx.source(worker), 0))
                conn.request("POST", HANDSHAKE, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                status: int | None = resp.status
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                status = None
                if conn is not None:
                    conn.close()
                conn = None
            with lock:
                statuses.append(status)
        if conn is not None:
            conn.close()

    with measured(ctx, "step 1 flood, sniffed key id", "control") as result:
        workers = [threading.Thread(target=flood, args=(w,), daemon=True) for w in range(threads)]
        for w in workers:
            w.start()
        member = []
        while any(w.is_alive() for w in workers):
            member.append(_timed(lambda: _member_handshake(ctx)))
            for w in workers:
                w.join(1.0 / threads)
        for st in statuses:
            result.sent += 1
            result.answer(f"HTTP {st}" if st is not None else "connection failed", st)
        if len(statuses) < count:
            result.note(f"stopped after {len(statuses)} of {count} step 1s: {FLOOD_SECONDS:g} s passed")
        ok = sum(m.startswith("HTTP 200") for m in member)
        result.note(f"member handshakes during the flood: {ok} of {len(member)} accepted"
                    + ("" if ok == len(member) else f" ({', '.join(sorted(set(member)))[:160]})"))


def _member_handshake(ctx: AttackContext) -> tuple[int, object]:
    """Both steps as the third member; the status of the first refused step, or of step 2."""
    initiator = member_initiator(ctx)
    code, reply = ctx.target.post(HANDSHAKE, initiator.step1(), auth=False)
    if code != 200:
        return code, reply
    return ctx.target.post(HANDSHAKE, initiator.step2(reply), auth=False)


def member_initiator(ctx: AttackContext) -> HandshakeInitiator:
    """A handshake as a real member (the third one: its identity, addresses and the pool key)
    would start it; accepting it only tells the target of a member it knows already."""
    member = next(sc for sc in ctx.pool.members() if sc is not ctx.target and sc.index != 1)
    pool = ctx.pool
    hello = make_hello(fingerprint=pool.config.fingerprint, hash_seed=pool.hash_seed,
                       kv_bytes_per_chunk=pool.chunk_bytes, identity=member.identity,
                       control_address=member.address, data_address=member.status()["data_address"],
                       transport=pool.transport, run_config=pool.config.run_config(),
                       model_identity=pool.model_identity)
    return HandshakeInitiator(pool.pool_key, hello)


def _timed(call) -> str:
    started = time.monotonic()
    try:
        code, _ = call()
    except urllib.error.HTTPError as exc:
        code = exc.code
    except (OSError, HandshakeError) as exc:
        return f"{type(exc).__name__} after {1e3 * (time.monotonic() - started):.0f} ms"
    return f"HTTP {code} in {1e3 * (time.monotonic() - started):.0f} ms"


def _post_from(ctx: AttackContext, source: str, path: str, body: dict | None,
               headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, object]:
    """A request from ``source`` (not 127.0.0.1): its status (0 for none) and JSON body."""
    request = http_request("POST" if body is not None else "GET", path,
                           json.dumps(body).encode() if body is not None else b"", headers)
    answer = http_exchange(ctx.host, ctx.port, request, source)
    if answer.status is None:
        raise ConnectionError(answer.word)
    try:
        reply = json.loads(answer.data.partition(b"\r\n\r\n")[2])
    except ValueError:
        reply = None
    return answer.status, reply


def legitimate_calls(ctx: AttackContext) -> dict[str, str]:
    """What the pool's own callers get from the target right now: a member from 127.0.0.1
    (an address that proved the key before), and a new pod, an admin and a Prometheus
    scrape from NEW_POD_SOURCE (an address that never proved anything)."""
    new = NEW_POD_SOURCE
    token = (("Authorization", f"Bearer {ctx.target.admin_token}"),)
    initiator = member_initiator(ctx)

    def new_pod_handshake() -> tuple[int, object]:
        code, reply = _post_from(ctx, new, HANDSHAKE, initiator.step1())
        if code != 200:
            return code, reply
        return _post_from(ctx, new, HANDSHAKE, initiator.step2(reply))

    calls = {"a member's handshake from 127.0.0.1 (proven before)": _timed(lambda: _member_handshake(ctx)),
            f"a /metrics scrape from {new} (never proven)": _timed(lambda: _post_from(ctx, new, "/metrics", None)),
            f"an admin's /v1/status from {new}": _timed(lambda: _post_from(ctx, new, "/v1/status", None, token)),
            f"a new pod's handshake from {new}": _timed(new_pod_handshake)}
    if not ctx.data_address.startswith("ucx://"):
        session = _member_session(ctx)
        for source in ("127.0.0.1", new):
            calls[f"a member's new data connection from {source}"] = (
                data_authenticate(ctx.data_address, source, session.session_id, session.session_key)
                if session is not None else "no session (the handshake was refused)")
    return calls


def _member_session(ctx: AttackContext) -> Session | None:
    """A session of the third member, by a handshake from 127.0.0.1 (None when refused)."""
    initiator = member_initiator(ctx)
    try:
        code, reply = ctx.target.post(HANDSHAKE, initiator.step1(), auth=False)
        if code != 200:
            return None
        code, reply = ctx.target.post(HANDSHAKE, initiator.step2(reply), auth=False)
        return initiator.finish(reply)[1] if code == 200 else None
    except (OSError, HandshakeError):
        return None


def replayed_steps(ctx: AttackContext) -> int:
    """A member's real handshake transcript (member C's hello, its key), then its step 1 and
    step 2 bodies sent again by strangers. Returns replays answered with 200."""
    initiator = member_initiator(ctx)
    step1 = initiator.step1()
    accepted = 0
    with measured(ctx, "replayed handshake steps", "control") as result:
        code, reply = ctx.target.post(HANDSHAKE, step1, auth=False)
        step2 = initiator.step2(reply) if code == 200 else None
        code2 = ctx.target.post(HANDSHAKE, step2, auth=False)[0] if step2 else None
        result.note(f"the captured handshake itself: step 1 -> {code}, step 2 -> {code2}")
        for i in ctx.rounds(ctx.repeats, result):
            _send(ctx, result, http_request("POST", HANDSHAKE, json.dumps(step1).encode()), i, "step 1: ")
            if step2 is not None:
                a = _send(ctx, result, http_request("POST", HANDSHAKE, json.dumps(step2).encode()), i, "step 2: ")
                accepted += a.status == 200
        if accepted:
            result.note(f"{accepted} replayed step 2s were ACCEPTED")
    return accepted
