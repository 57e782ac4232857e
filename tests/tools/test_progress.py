"""Progress lines go to stderr only, stamped with the command and the time unless quiet."""

import re

from kv_offload_tools.progress import rows_to, timestamped, to_stderr


def test_to_stderr_leaves_stdout_to_the_report(capsys) -> None:
    to_stderr("[demo] 3/10 requests")
    out, err = capsys.readouterr()
    assert (out, err) == ("", "[demo] 3/10 requests\n")


def test_timestamped_names_the_command_and_the_time(capsys) -> None:
    timestamped("chaos")("wrote chaos.png")
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(r"\[chaos \d\d:\d\d:\d\d\] wrote chaos\.png\n", err), err


def test_timestamped_quiet_prints_nothing(capsys) -> None:
    timestamped("attack", quiet=True)("starting 3 tcp sidecars")
    assert capsys.readouterr() == ("", "")


def test_rows_go_to_stdout_unless_stdout_carries_the_json(capsys) -> None:
    rows_to(False)("round 1")
    rows_to(True)("round 2")
    assert capsys.readouterr() == ("round 1\n", "round 2\n")
