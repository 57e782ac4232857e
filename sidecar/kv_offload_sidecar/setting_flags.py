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

Settings may be grouped, as kopf groups ``OperatorSettings``: a field declared with
``group(cls, about)`` holds a frozen dataclass of its own whose setting fields are flags too.
``flag_fields``, ``add_flags``, ``flag_values`` and ``field_default`` then see the groups'
fields as if they were the outer class's (a field name is unique across groups, so a flag's
dest stays the field's name), ``setting_groups`` lists the groups (their argparse groups in
``--help``), and ``grouped`` builds the nested struct from one keyword per field.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

# Field metadata key holding a field's FlagSpec.
_FLAG = "flag"
# Field metadata key holding a group field's GroupSpec.
_GROUP = "group"


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


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What a group field holds: the dataclass of its settings and what they decide."""

    # The frozen dataclass of the group's settings.
    cls: type
    # One line: what the group decides (its heading's text in --help and the reference page).
    about: str


@dataclasses.dataclass(frozen=True)
class SettingGroup:
    """Flags a user tunes together: one argparse group of ``--help`` (``setting_groups``)."""

    # The group's field name, e.g. "data_plane" (the heading in --help and in the reference page).
    name: str
    # One line: what the group decides.
    about: str
    # The names of the group's flag fields, in declaration (and --help) order.
    fields: tuple[str, ...]


def setting(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:  # noqa: A002
    """A dataclass field that is also a flag (see ``FlagSpec`` for ``spec``)."""
    return dataclasses.field(default=default, metadata={_FLAG: FlagSpec(help=help, **spec)})


def group(cls: type, about: str, *, required: bool = False) -> Any:
    """A dataclass field holding the settings of ``cls``; defaults to ``cls()`` unless ``required``."""
    factory = dataclasses.MISSING if required else cls
    return dataclasses.field(default_factory=factory, metadata={_GROUP: GroupSpec(cls, about)})


def group_fields(cls: type) -> list[tuple[dataclasses.Field[Any], GroupSpec]]:
    """The fields of ``cls`` that hold a group, in declaration order."""
    return [(f, f.metadata[_GROUP]) for f in dataclasses.fields(cls) if _GROUP in f.metadata]


def leaf_fields(cls: type) -> list[tuple[str, dataclasses.Field[Any]]]:
    """(group name, field) of every field of ``cls`` and of its groups ("" for its own), in order."""
    out: list[tuple[str, dataclasses.Field[Any]]] = []
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            out += [(f.name, leaf) for _, leaf in leaf_fields(f.metadata[_GROUP].cls)]
        else:
            out.append(("", f))
    return out


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], FlagSpec]]:
    """The fields of ``cls`` (and of its groups) that are flags, in declaration order."""
    return [(f, f.metadata[_FLAG]) for _, f in leaf_fields(cls) if _FLAG in f.metadata]


def setting_groups(cls: type) -> tuple[SettingGroup, ...]:
    """The groups of ``cls`` with the names of their flags, in declaration order."""
    return tuple(SettingGroup(f.name, spec.about, tuple(g.name for g, _ in flag_fields(spec.cls)))
                 for f, spec in group_fields(cls))


def grouped(cls: type, values: Mapping[str, Any]) -> Any:
    """A ``cls`` from one keyword per field, each given to the group that declares it;
    a group none of whose fields is given takes its default. TypeError names unknown keys."""
    rest = dict(values)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if _GROUP not in f.metadata:
            if f.name in rest:
                kwargs[f.name] = rest.pop(f.name)
            continue
        inner = f.metadata[_GROUP].cls
        mine = {g.name: rest.pop(g.name) for g in dataclasses.fields(inner) if g.name in rest}
        if mine or f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = inner(**mine)
    if rest:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(rest))}")
    return cls(**kwargs)


def flag_name(f: dataclasses.Field[Any], spec: FlagSpec) -> str:
    return spec.flag or "--" + f.name.replace("_", "-")


def field_default(cls: type, name: str) -> Any:
    """The declared default of field ``name`` of ``cls`` or of one of its groups (KeyError when it has none)."""
    (f,) = [f for _, f in leaf_fields(cls) if f.name == name]
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
