"""Flags built from a settings dataclass: name, type, default and help come from the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
from kv_offload_sidecar.setting_flags import (
    add_flags,
    field_default,
    flag_values,
    group,
    grouped,
    setting,
    setting_groups,
)


@dataclass(frozen=True)
class Example:
    path: str = setting(help="a file", metavar="FILE", required=True)
    port: int = setting(5710, "a port", default_text="$EXAMPLE_PORT, else 5710")
    ratio: float = setting(0.5, "a ratio")
    mode: str = setting("drop", "a mode", choices=("drop", "cold"))
    everywhere: bool = setting(False, "a switch", flag="--all", aliases=("-A",))
    # Not a flag.
    internal: int = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, Example)
    return p


def test_a_flag_not_given_takes_the_fields_default_and_parses_to_its_type():
    args = parser().parse_args(["--path", "f", "--ratio", "2"])
    assert flag_values(args, Example) == {"path": "f", "ratio": 2.0, "mode": "drop", "everywhere": False}
    assert Example(**flag_values(args, Example)) == Example(path="f", ratio=2.0)


def test_a_flag_whose_default_comes_from_elsewhere_is_left_out_until_given():
    assert "port" not in flag_values(parser().parse_args(["--path", "f"]), Example)
    assert flag_values(parser().parse_args(["--path", "f", "--port", "6000"]), Example)["port"] == 6000


def test_the_help_states_the_default_once_and_none_for_a_required_flag():
    helps = {a.dest: a.help for a in parser()._actions}
    assert helps["port"] == "a port (default $EXAMPLE_PORT, else 5710)"
    assert helps["ratio"] == "a ratio (default 0.5)" and helps["path"] == "a file"
    assert helps["everywhere"] == "a switch" and "internal" not in helps


def test_names_aliases_and_choices_come_from_the_field():
    args = parser().parse_args(["--path", "f", "-A", "--mode", "cold"])
    assert (args.everywhere, args.mode) == (True, "cold")
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser().parse_args(["--path", "f", "--mode", "keep"])


def test_field_default_names_a_field_without_one():
    assert field_default(Example, "ratio") == 0.5
    with pytest.raises(KeyError, match="Example.path has no default"):
        field_default(Example, "path")


@dataclass(frozen=True)
class Wire:
    speed: int = setting(1, "a speed")


@dataclass(frozen=True, kw_only=True)
class Grouped:
    example: Example = group(Example, "what the example decides", required=True)
    wire: Wire = group(Wire, "how fast")


def test_a_groups_fields_are_flags_of_the_outer_class_and_its_groups_list_them():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, Grouped)
    args = p.parse_args(["--path", "f", "--speed", "3"])
    assert flag_values(args, Grouped) == {"path": "f", "ratio": 0.5, "mode": "drop", "everywhere": False, "speed": 3}
    assert [(g.name, g.about, g.fields) for g in setting_groups(Grouped)] == [
        ("example", "what the example decides", ("path", "port", "ratio", "mode", "everywhere")),
        ("wire", "how fast", ("speed",))]
    assert field_default(Grouped, "speed") == 1


def test_grouped_gives_each_keyword_to_its_group_and_defaults_the_groups_not_named():
    built = grouped(Grouped, {"path": "f", "internal": 4})
    assert built == Grouped(example=Example(path="f", internal=4), wire=Wire())
    with pytest.raises(TypeError, match="Grouped has no setting nope"):
        grouped(Grouped, {"path": "f", "nope": 1})
    with pytest.raises(TypeError):  # a required group needs its own required fields
        grouped(Grouped, {"speed": 2})
