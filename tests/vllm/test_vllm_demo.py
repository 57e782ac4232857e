"""`kv-offload demo --engine vllm`: the demo with real vLLM engines, run as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def _kv_offload() -> list[str]:
    script = Path(sys.executable).with_name("kv-offload")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kv_offload_operator.cli"]


def test_demo_with_real_vllm_engines_shares_a_prefix_between_pods_and_rejects_the_intruder():
    out = subprocess.run([*_kv_offload(), "demo", "--engine", "vllm", "--pods", "2",
                          "--requests", "4"], capture_output=True, text=True, timeout=540,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[demo] 3 engines ready" in out.stderr  # two pods and the engine without offloading
    total = next(line for line in out.stdout.splitlines() if line.startswith("total"))
    cols = re.split(r"\s{2,}", total)
    # total  requests  prompt tokens  vLLM cached  of which p2p  tier chunk hits  local hits
    #        peer hits  misses  bytes moved  rejections  outputs differing
    requests, cached, p2p, tier_hits, peer_hits = (int(cols[i]) for i in (1, 3, 4, 5, 7))
    rejections, differing = int(cols[10]), int(cols[11])
    assert requests == 4 and differing == 0
    # Trace request 4 (pod-1) shares five chunks with request 1 (pod-0): vLLM loads them from
    # the peer and counts them as p2p tokens; the tier's chunk hits and the sidecars' agree.
    assert p2p == 5 * 64 and cached >= p2p, out.stdout
    assert tier_hits == peer_hits == 5, out.stdout
    assert rejections >= 2  # each pod rejected the intruder with another hash seed
    assert "outputs differing from an engine without offloading: 0" in out.stdout


def test_demo_refuses_an_unknown_engine_with_the_choices():
    out = subprocess.run([*_kv_offload(), "demo", "--engine", "gpu"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "choose from 'sim', 'vllm'" in out.stderr
