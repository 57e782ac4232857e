"""A bench run through the command line that stores a record: its report and its record agree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from refusal import bench


def recorded_run(name: str, args: list[str], tmp_path: Path,
                 timeout: float = 600) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``kv-offload bench <name> args --json --record tmp_path/records``, once it exited 0:
    the report it printed, the one record it stored (which holds that report and no notes)
    and its stderr."""
    records = tmp_path / "records"
    done = subprocess.run([*bench(name), *args, "--json", "--record", str(records)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (path,) = (records / name).glob("*.json")
    record = json.loads(path.read_text())
    assert record["report"] == report and record["notes"] == {}
    return report, record, done.stderr
