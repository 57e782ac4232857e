"""A bench's numeric flags from one table: typed as their default, their bound in the help, and a
value under the bound (NaN too) refused naming the flag and the bound."""

from __future__ import annotations

import argparse

import pytest
from kv_offload_sidecar.usage import UsageError
from kv_offload_tools.bench.number_flags import add_number_flags, check_number_flags

FLAGS = (("--rounds", 20, 1, "kills"), ("--within-seconds", 10.0, 0.1, "the target"))


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_number_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    check_number_flags(args, FLAGS)
    return args


def test_flags_are_typed_as_their_default_and_state_their_bound() -> None:
    parser = argparse.ArgumentParser()
    add_number_flags(parser, FLAGS)
    assert "kills; at least 1 (default 20)" in " ".join(parser.format_help().split())
    args = _parsed("--rounds", "3", "--within-seconds", "2.5")
    assert (args.rounds, args.within_seconds) == (3, 2.5) and isinstance(args.rounds, int)


@pytest.mark.parametrize(("argv", "said"), [
    (["--rounds", "0"], "--rounds 0 must be at least 1"),
    (["--within-seconds", "nan"], "--within-seconds nan must be at least 0.1"),
])
def test_a_value_under_its_bound_is_refused_naming_flag_and_bound(argv: list[str], said: str) -> None:
    with pytest.raises(UsageError) as refused:
        _parsed(*argv)
    assert str(refused.value) == said
