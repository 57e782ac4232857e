"""`kv-offload bench netns`: bad input is one line and exit 2 before any namespace is made.

The measurement itself runs a minute and more (it is the bench's to run, not the suite's);
its parts are tested where they live (tests/tools/netns)."""

from __future__ import annotations

from refusal import bench, refuses_each

CLI = bench("netns")


test_bad_input_is_one_line_and_exit_2 = refuses_each(CLI, {
    "too-few-pods": (["--pods", "2"], "--pods 2 must be between 3 and 16"),
    "too-many-pods": (["--pods", "17"], "--pods 17 must be between 3 and 16"),
    "cut": (["--cut-seconds", "0"], "--cut-seconds 0 must be at least 1"),
    "before": (["--before-seconds", "1"], "--before-seconds 1 must be at least 2"),
    "deadline-nan": (["--fetch-deadline-seconds", "nan"], "--fetch-deadline-seconds nan must be at least 0.1"),
    "scenario": (["--scenarios", "capped,storm"],
                 "--scenarios 'capped,storm': unknown storm; valid: isolate, capped, churn, reused, resolver, domain"),
    "churn-pods": (["--churn-pods", "15"], "--churn-pods 15 must be at most 14"),
    "cap": (["--cap-bits", "100"], "--cap-bits 100 must be at least 8000"),
})
