"""`kv-offload bench netns`: bad input is one line and exit 2 before any namespace is made.

The measurement itself runs a minute and more (it is the bench's to run, not the suite's);
its parts are tested where they live (tests/tools/netns)."""

from __future__ import annotations

import pytest
from refusal import bench, refusal

CLI = bench("netns")


@pytest.mark.parametrize(("args", "named"), [
    (["--pods", "2"], "--pods 2 must be between 3 and 16"),
    (["--pods", "17"], "--pods 17 must be between 3 and 16"),
    (["--cut-seconds", "0"], "--cut-seconds 0 must be at least 1"),
    (["--before-seconds", "1"], "--before-seconds 1 must be at least 2"),
    (["--fetch-deadline-seconds", "nan"], "--fetch-deadline-seconds nan must be at least 0.1"),
    (["--scenarios", "capped,storm"], "--scenarios 'capped,storm': unknown storm; valid: isolate, capped, "
                                      "churn, reused, resolver, domain"),
    (["--churn-pods", "15"], "--churn-pods 15 must be at most 14"),
    (["--cap-bits", "100"], "--cap-bits 100 must be at least 8000"),
], ids=["too-few-pods", "too-many-pods", "cut", "before", "deadline-nan", "scenario", "churn-pods", "cap"])
def test_bad_input_is_one_line_and_exit_2(args: list[str], named: str) -> None:
    assert refusal(CLI, *args) == named
