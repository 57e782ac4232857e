"""`kv-offload bench chaos`: bad input is one line and exit 2, before any sidecar starts; a
tiny fault run on nixl sidecars delivers nothing corrupt, loses nothing, and refuses the
chunks whose holder slots were flipped under its READs; the late-writer row alone writes no
byte after a deadline on tcp and tls, and its gates refused the late writes.

The fault and fuzz runs themselves are tested under tests/tools/chaos.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from refusal import bench, refusal, refuses_each

CLI = bench("chaos")


test_bad_input_is_one_line_and_exit_2 = refuses_each(CLI, {
    "kills": (["--kills", "0"], "--kills 0 must be at least 1"),
    "fuzz-cases": (["--fuzz", "--fuzz-cases", "5"], "--fuzz-cases 5 must be at least 6"),
    "seconds": (["--seconds", "0"], "--seconds 0.0 must be positive"),
    "chunk-bytes": (["--chunk-bytes", "5000"], "--chunk-bytes 5000 must be a positive multiple of 4096"),
    "slot-rounds": (["--slot-rounds", "0"], "--slot-rounds 0 must be at least 1"),
    "fuzz-nixl": (["--fuzz", "--transport", "nixl"],
                  "--fuzz runs against a tcp sidecar; --transport nixl applies to the fault run"),
    "late-writer-runs": (["--late-writer-runs", "-1"], "--late-writer-runs -1 must be at least 0"),
    "late-writer-only": (["--late-writer-only", "--late-writer-runs", "0"],
                         "--late-writer-only needs --late-writer-runs of at least 1 and no --fuzz"),
})


def test_a_nixl_run_without_an_importable_nixl_is_one_line_and_exit_2(tmp_path: Path) -> None:
    stub = tmp_path / "nixl_cu12"
    stub.mkdir()
    (stub / "__init__.py").write_text('raise ImportError("libnixl.so: cannot open shared object file")\n')
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    line = refusal(CLI, "--transport", "nixl", "--plot", "", env=env)
    assert line.startswith("kv-offload bench chaos --transport nixl: the nixl transport needs NVIDIA NIXL")
    assert "libnixl.so" in line and "pip install --no-deps nixl-cu12" in line


def test_a_tiny_nixl_fault_run_delivers_nothing_corrupt_and_loses_nothing() -> None:
    """Every fault class once or a few times on nixl sidecars (~25 s): slot bytes flipped under
    the hub's READs are refused by checksum, never delivered, and load intact once restored.
    The late-writer row has a test of its own (below)."""
    done = subprocess.run(
        [*CLI, "--transport", "nixl", "--json", "--quiet", "--plot", "", "--servers", "1",
         "--chunk-bytes", "16384", "--kills", "1", "--wire-kills", "1", "--rounds", "1",
         "--wire-rounds", "2", "--slot-rounds", "3", "--seconds", "20", "--late-writer-runs", "0"],
        capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["settings"]["transport"] == "nixl"
    faults = {f["fault"]: f for f in report["faults"]}
    assert {"wire_flip", "slot_flip", "sigkill_mid_fetch", "sigkill_at_byte",
            "restart_under_engine"} <= set(faults)
    assert [f["fault"] for f in report["faults"] if f["corrupt_delivered"] or f["lost"]] == []
    slot = faults["slot_flip"]
    assert slot["injected"] == 3 and slot["survived"] == 3
    assert slot["integrity_rejected"] > 0  # the first round flips before the READs: always refused
    assert slot["loads_missed"] >= 1
    assert report["ok"] is True
    assert report["late_writer"] == []


def test_the_late_writer_row_writes_no_byte_after_a_deadline_and_its_gates_refused() -> None:
    """Two runs of each late-writer case on tcp, tls, ucx and nixl holder sidecars (~40 s)."""
    done = subprocess.run([*CLI, "--late-writer-only", "--late-writer-runs", "2", "--json", "--quiet",
                           "--plot", ""], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["faults"] == [] and report["ok"] is True
    planes = {r["plane"]: r for r in report["late_writer"]}
    assert set(planes) == {"tcp", "tls", "ucx", "nixl"}
    for r in planes.values():
        assert r["runs"] == 2 and r["bytes_after_deadline"] == 0, r
        assert r["chunks_verified"] == r["chunks_stored"] >= 4, r  # the reused slot verifies
        assert r["unexpected_endings"] == 0, r
    for r in (planes["tcp"], planes["tls"]):
        assert r["holder_stopped_in_flight"] >= 1, r  # a SIGSTOP landed mid-chunk
        # Each resumed holder's bytes were refused by the gate.
        assert r["refused_holder_stopped"] >= r["holder_stopped_in_flight"], r
    # ucx: the stopped holder's slot stayed held until its write was over (a run in flight
    # whose slot was free is an unexpected ending; a holder stopped after its last byte but
    # before its completion holds one too).
    assert planes["ucx"]["slots_held"] >= planes["ucx"]["holder_stopped_in_flight"] >= 1, planes["ucx"]
    # nixl: every READ posted past the deadline was refused by the lane's gate check.
    assert planes["nixl"]["refused_loop_blocked"] == planes["nixl"]["loop_blocked_in_flight"] == 2, planes["nixl"]
