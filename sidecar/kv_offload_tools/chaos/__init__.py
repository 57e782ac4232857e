"""Fault injection and fuzzing against live sidecar processes (``kv-offload bench chaos``).

- ``pool``: the LocalPool the chaos runs act on (its config and defaults);
- ``chunks``: deterministic chunk contents, so every delivered chunk is checked byte for byte;
- ``probes``: a hand-driven peer (handshake, raw data-plane frames);
- ``fault_proxy``: a TCP proxy that damages data-plane bytes on purpose;
- ``late_writer``: the fetcher's side of the late-writer cases (a holder stopped mid-chunk, a
  loop blocked past a row's deadline), shared by the tests and the bench's late-writer row;
- ``faults/``: the fault scenarios; ``fuzz/``: the fuzz targets and their runner;
- ``loop``: the one event loop of a process's hand-driven peers (the NIXL runtime binds to it);
- ``report``: tables and plots of both runs.
"""
