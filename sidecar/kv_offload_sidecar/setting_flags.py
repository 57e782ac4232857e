"""Command-line flags built from a frozen settings dataclass, so a default is written once.

A field declared with ``setting(default, help)`` is a flag: ``--<name with dashes>``
(or the ``flag`` given), its argparse type that of the default, its help the
field's one line plus ``(default: ...)``. ``add_flags`` adds them to a parser;
``flag_values`` reads them back as keyword arguments for the dataclass. A flag
whose default comes from somewhere else first (an environment variable, a file)
says so in ``default_text`` and parses to None when not given: the caller
fills it in, or the field's own default applies. Used by
``kv-offload sidecar`` (``SidecarSettings``) and ``kv-offload operator``
(``OperatorOptions``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

# Field metadata key holding a field's FlagSpec.
_FLAG = "flag"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one settings field appears on the command line."""

    # One line saying what the setting does (the field's comment and the flag's help).
    help: str
    # Flag name, e.g. "--peers"; "" = "--" + the field name with dashes.
    flag: str = ""
    # argparse metavar, e.g. "FILE"; "" = argparse's own.
    metavar: str = ""
    # The allowed values (argparse choices); () = any value of the default's type.
    choices: tuple[Any, ...] = ()
    # The flag must be given.
    required: bool = False
    # Text of the default in the help when it is not the field's own, e.g.
    # "$VLLM_P2P_SIDE_CHANNEL_PORT, else 5710"; the flag then parses to None when not given.
    default_text: str = ""
    # Short aliases besides the flag, e.g. ("-n",).
    aliases: tuple[str, ...] = ()


def setting(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:  # noqa: A002
    """A dataclass field that is also a flag (see ``FlagSpec`` for ``spec``)."""
    return dataclasses.field(default=default, metadata={_FLAG: FlagSpec(help=help, **spec)})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], FlagSpec]]:
    """The fields of ``cls`` that are flags, in declaration order."""
    return [(f, f.metadata[_FLAG]) for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def flag_name(f: dataclasses.Field[Any], spec: FlagSpec) -> str:
    return spec.flag or "--" + f.name.replace("_", "-")


def field_default(cls: type, name: str) -> Any:
    """The declared default of field ``name`` of ``cls`` (KeyError when it has none)."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    if f.default is dataclasses.MISSING:
        raise KeyError(f"{cls.__name__}.{name} has no default")
    return f.default


def add_flags(parser: argparse.ArgumentParser | argparse._ActionsContainer, cls: type,
              names: Sequence[str] | None = None) -> None:
    """Add the flags of ``cls`` (only ``names`` when given) to ``parser`` (or a group)."""
    for f, spec in flag_fields(cls):
        if names is not None and f.name not in names:
            continue
        has_default = f.default is not dataclasses.MISSING
        kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = type(f.default) if isinstance(f.default, (int, float)) else str
        if spec.default_text:
            kwargs["default"] = None
            kwargs["help"] += f" (default {spec.default_text})"
        elif has_default:
            kwargs["default"] = f.default
            if f.default is not None and not isinstance(f.default, bool) and not spec.required:
                kwargs["help"] += f" (default {_show(f.default)})"
        if spec.metavar:
            kwargs["metavar"] = spec.metavar
        if spec.choices:
            kwargs["choices"] = spec.choices
        if spec.required:
            kwargs["required"] = True
        parser.add_argument(flag_name(f, spec), *spec.aliases, **kwargs)


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of ``cls`` as parsed, leaving out ``default_text`` flags that were not given."""
    return {f.name: getattr(args, f.name) for f, _ in flag_fields(cls)
            if getattr(args, f.name, None) is not None}


def _show(value: Any) -> str:
    text = '""' if value == "" else str(value)
    return text.replace("%", "%%")  # argparse formats help with %
