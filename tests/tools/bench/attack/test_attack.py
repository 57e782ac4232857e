"""`kv-offload bench attack`: bad input is one line and exit 2 before any sidecar starts; a
short run (about a minute) against three live sidecars leaves no traceback, no 500, every
member alive and connected, memory and logs within their targets, the honest load's hit
ratio as it was without attackers, and tells a stranger neither the wire version nor
accepts a replayed handshake.

The honest p99 target is printed by the bench, not asserted here: a speed target is read
from one full run's ratio (README, Security model), and in a run this short the host's
other load decides it. What a siege must not do to legitimate callers is asserted: a
member, a pod never seen before, an admin and a scrape are all served while it holds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from refusal import bench, refuses_each

CLI = bench("attack")


test_bad_input_is_one_line_and_exit_2 = refuses_each(CLI, {
    "connections": (["--connections", "5000"], "--connections 5000 must be in 5..1000"),
    "hold-seconds": (["--hold-seconds", "0"], "--hold-seconds 0 must be in (0, 600] seconds"),
    "sources": (["--sources", "0"], "--sources 0 must be in 1..200"),
    "members": (["--members", "1"], "--members 1 must be in 2..8 (one stores, another loads)"),
})


def test_a_short_attack_leaves_the_pool_whole_and_the_honest_load_hitting(tmp_path: Path) -> None:
    png = tmp_path / "attack.png"
    done = subprocess.run([*CLI, "--short", "--json", "--quiet", "--plot", str(png)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode in (0, 1), done.stderr[-4000:]
    report = json.loads(done.stdout)
    verdicts = {t["target"].split(" (")[0]: t for t in report["targets"]}
    held = [name for name, t in verdicts.items() if not t["pass"]]
    assert done.returncode == (1 if held else 0)

    # Every attack class ran, each got answers, the siege held connections on both ports.
    names = [a["name"].strip() for a in report["attacks"]]
    for wanted in ("control flood", "slow headers", "slow body", "data flood", "auth frame 1 MiB",
                   "request line 70 kB", "header 70 kB", "300 headers", "bearer token 9 kB",
                   "deeply nested JSON", "5000-digit integers", "rejected handshake flood",
                   "other wire version", "replayed handshake steps", "malformed frames (tcp)",
                   "local channel garbage", "member of another pool",
                   "other weights, same name and path"):
        assert wanted in names, names
    assert all(a["sent"] > 0 for a in report["attacks"]), report["attacks"]

    # While the siege held every stranger's place, the pool's own callers were served: a new
    # pod's handshake took a stranger's place, a proof on either port opened the data port.
    during = report["during_siege"]
    assert all(answer.startswith(("HTTP 200", "AUTH_OK")) for what, answer in during.items()
               if what != "members connected"), during

    # Nothing an outsider sent crashed a parse path or a member.
    assert report["tracebacks"] == {"sidecar-0": {}, "sidecar-1": {}, "sidecar-2": {}}
    assert verdicts["0 tracebacks in the members' logs"]["pass"]
    assert verdicts["0 responses of 500"]["pass"]
    assert verdicts["every member alive and connected"]["pass"], verdicts
    # No chunk byte before authentication on the data port: an ERROR and a close each time.
    frames = next(a for a in report["attacks"] if a["name"] == "malformed frames (tcp)")
    assert all("ERROR(" in word and "CHUNK+" not in word for word in frames["answers"]), frames["answers"]

    # The honest load kept hitting: the same ratio as without attackers, nothing wrong delivered.
    honest = report["honest"]
    assert honest["error"] is None
    assert honest["without_attackers"]["rounds"] > 50 and honest["under_attack"]["rounds"] > 50
    assert honest["under_attack"]["wrong"] == 0
    assert verdicts["honest hit ratio unchanged"]["pass"], verdicts

    # A stranger learns nothing before the proof and cannot replay a member's handshake.
    assert verdicts["no wire version told before the proof"]["pass"]
    assert verdicts["replayed handshake steps refused"]["pass"]
    # A key holder of other weights under the same name and path is refused and gets no byte.
    other = next(a for a in report["attacks"] if a["name"] == "other weights, same name and path")
    assert any("(model_mismatch)" in k and v >= 1 for k, v in other["answers"].items()), other
    assert verdicts["0 chunk bytes to a key holder of other weights"]["pass"], verdicts
    # The siege's memory came back; the rejections were summarised, not logged one by one.
    assert verdicts["RSS growth at peak <= 32 MiB"]["pass"], verdicts
    assert verdicts["RSS growth after <= 8 MiB"]["pass"], verdicts
    assert verdicts["log growth <= 64 KiB per minute of attack"]["pass"], verdicts

    assert png.stat().st_size > 10_000
