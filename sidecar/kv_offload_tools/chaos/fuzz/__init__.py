"""Hypothesis fuzzing of every message a live sidecar accepts.

Targets (each a ``runner.FuzzTarget``: a hypothesis strategy of cases and a
function that sends one case to the live sidecar and judges the answer):

- ``control_targets``: ``handshake`` (``POST /v1/handshake`` bodies: mutated
  hellos with fields dropped, retyped, oversized, other fingerprints, seeds or
  sizes; proof steps; arbitrary JSON and bytes) and ``lookup``
  (``POST /v1/lookup`` bodies);
- ``directory_targets``: ``directory`` (``POST /v1/publish`` and ``/v1/locate``
  without a session or with a wrong HMAC) and ``directory_session`` (arbitrary
  bodies of an authenticated peer);
- ``local_targets``: ``local``, local-channel frames (every op with arbitrary
  fields, broken JSON, lying lengths) on the engine's Unix socket;
- ``data_targets``: ``data_preauth``, arbitrary bytes and frames on a data
  connection before authentication, and ``data_frames``, arbitrary frame
  streams (LOOKUP, FETCH, CLOSE, every other type, wrong lengths) on an
  authenticated data connection.

Each case must end in a clear error (HTTP 4xx with a JSON ``error``,
``{"ok": false, "error"}``, an ERROR frame then a closed connection) or in
the correct answer, computed independently: the sidecar holds a known set of
chunks whose bytes are ``chunk_content(key)`` (``context``). A 5xx, a wrong
answer, a chunk byte before authentication, a dead process or a sidecar that
stops answering ``/healthz`` is a failure; the RSS of the process is sampled
from ``/proc`` and must stay within a bound of its value after warm-up
(``runner``).
"""
