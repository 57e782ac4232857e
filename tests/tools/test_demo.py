"""`kv-offload demo`: real sidecars and simulated engines share chunks, byte-exact."""

import os
import re
import subprocess
import sys

from kv_offload_tools.demo import format_report, run_demo


def _cli(*args, timeout=150):
    exe = os.path.join(os.path.dirname(sys.executable), "kv-offload")
    return subprocess.run([exe, "demo", *args], capture_output=True, text=True, timeout=timeout)


def test_short_demo_shares_chunks_between_pods_with_zero_mismatched_bytes():
    lines = []
    report = run_demo(pods=3, requests=120, progress=lines.append)
    total = report.total
    assert report.requests == 120 and lines
    assert total.mismatched_bytes == 0 and total.failed_loads == 0
    assert total.peer_hits > 0 and total.local_hits > 0
    assert total.lookups == total.local_hits + total.peer_hits + total.misses
    assert total.bytes_moved > 0 and total.handshake_rejections == 0
    assert all(p.requests == 40 for p in report.pods)
    table = format_report(report)
    assert "peer hits" in table and "total" in table and report.pods[0].metrics_url in table


def test_demo_command_prints_the_table_and_rejects_an_intruder():
    out = _cli("--pods", "2", "--requests", "40", "--intruder")
    assert out.returncode == 0, out.stderr
    assert "[demo] 40/40 requests" in out.stderr
    total = re.search(r"^total\s+40\s.*$", out.stdout, re.M)
    assert total, out.stdout
    columns = total.group(0).split()
    # total requests lookups local peer misses ratio bytes unit p50 p99 rejections mismatched
    assert int(columns[11]) >= 2, out.stdout  # each pod rejected the other hash seed
    assert columns[12] == "0" and "mismatched bytes 0" in out.stdout


def test_demo_command_rejects_bad_input_with_one_line():
    out = _cli("--pods", "1")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "--pods" in out.stderr
