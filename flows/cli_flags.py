"""The `rlhf` command's flags, generated: one per config field (its `Field(description=...)` the help), with OpenRLHF's
0.9 and 0.11 spellings from `flows.openrlhf_flags` as aliases, and a flag of its own for each OpenRLHF flag that is
mapped, refused or converted; `apply_openrlhf_flags` turns parsed flags into config values."""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from typing import Any, Sequence

from pydantic import BaseModel

from flows.openrlhf_flags import IMPLEMENTED, MAPPED, REFUSED, flags_for
from rlhf_core.errors import UserError


def _flag_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse keyword arguments for a pydantic field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _flag_type(inner[0])
    if annotation is bool:
        return None, {"action": "store_true", "default": argparse.SUPPRESS}
    if origin is tuple:
        item_types = typing.get_args(annotation)
        return None, {"nargs": len(item_types), "type": item_types[0], "default": argparse.SUPPRESS}
    if origin is list:
        return None, {"nargs": "+", "default": argparse.SUPPRESS}
    if origin is dict:
        return None, {"type": json.loads, "default": argparse.SUPPRESS, "metavar": "JSON"}
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return None, {"type": type(choices[0]), "choices": choices, "default": argparse.SUPPRESS}
    return None, {"type": annotation, "default": argparse.SUPPRESS}


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], exclude: set[str] = frozenset(),
                    aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per field of `model`, its help the field's description; `aliases` adds other spellings."""
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        _, kwargs = _flag_type(field.annotation)
        required = " (required)" if field.is_required() else ""
        spellings = [f"--{name}"] + [f"--{alias}" for alias in (aliases or {}).get(name, []) if alias != name]
        parser.add_argument(*spellings, dest=name, help=((field.description or "") + required).replace("%", "%%"),
                            **kwargs)


OPENRLHF_DEST = "openrlhf:"
# Where a parsed command line lists the 0.11 (dotted) spellings it used: they select 0.11's defaults.
DOTTED_SPELLINGS = f"{OPENRLHF_DEST}dotted"


def _noting_dotted_spellings(action_class: type[argparse.Action]) -> type[argparse.Action]:
    """`action_class` that also lists a dotted option string it was given under DOTTED_SPELLINGS: argparse gives an
    action the spelling used, and nothing else keeps it."""

    class NotingDottedSpellings(action_class):  # type: ignore[valid-type, misc]
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string and "." in option_string:
                setattr(namespace, DOTTED_SPELLINGS, [*getattr(namespace, DOTTED_SPELLINGS, []), option_string])
            super().__call__(parser, namespace, values, option_string)

    return NotingDottedSpellings


_TAKES = {"switch": {"action": "store_true"}, "value": {}, "pair": {"nargs": 2}, "list": {"nargs": "*"}}


def add_openrlhf_flags(parser: argparse.ArgumentParser, cli: str, models: Sequence[type[BaseModel]],
                       exclude: set[str] = frozenset()) -> None:
    """Our fields' flags, with OpenRLHF's spellings (0.9 and 0.11's dotted ones) from `openrlhf_flags` as aliases,
    and one flag per OpenRLHF flag that is mapped, refused or converted (checked in `apply_openrlhf_flags`)."""
    for name, action_class in (("store", argparse._StoreAction), (None, argparse._StoreAction),
                               ("store_true", argparse._StoreTrueAction)):
        parser.register("action", name, _noting_dotted_spellings(action_class))
    aliases: dict[str, list[str]] = {}
    own_flags = _own_openrlhf_flags(cli, _field_names(models, exclude))
    for flag in flags_for(cli):
        if flag not in own_flags:
            aliases.setdefault(flag.field, []).extend(flag.spellings(cli))
    claimed = {name for flag in own_flags for name in flag.spellings(cli)}
    for model in models:
        add_model_flags(parser, model, exclude | claimed, aliases)
    group = parser.add_argument_group("OpenRLHF flags mapped or refused here (see docs/openrlhf-flags.md)")
    for index, flag in enumerate(own_flags):
        kwargs = dict(_TAKES[flag.takes])
        if flag.takes != "switch":
            kwargs.update(type=flag.value_type, metavar=("LOW", "HIGH") if flag.takes == "pair" else "VALUE")
        help_text = f"{flag.kind}: {flag.note or flag.field}".replace("%", "%%")
        group.add_argument(*(f"--{name}" for name in flag.spellings(cli)), dest=f"{OPENRLHF_DEST}{index}",
                           default=argparse.SUPPRESS, help=help_text, **kwargs)


def _field_names(models: Sequence[type[BaseModel]], exclude: set[str]) -> set[str]:
    return {name for model in models for name in model.model_fields} - exclude


def _own_openrlhf_flags(cli: str, fields: set[str]) -> list:
    """The OpenRLHF flags of `cli` that get a flag of their own: all but plain spellings of one of our fields."""
    return [flag for flag in flags_for(cli)
            if not (flag.kind == IMPLEMENTED and flag.convert is None and flag.field in fields)]


def apply_openrlhf_flags(cli: str, flags: dict[str, Any], models: Sequence[type[BaseModel]],
                         exclude: set[str] = frozenset()) -> dict[str, Any]:
    """Our field values from parsed flags: refused OpenRLHF flags at a non-default value are a UserError, mapped
    ones print their note once, and OpenRLHF's rank counts become --num_workers."""
    own_flags = _own_openrlhf_flags(cli, _field_names(models, exclude))
    values = {name: value for name, value in flags.items() if not name.startswith(OPENRLHF_DEST)}
    for index, flag in enumerate(own_flags):
        if f"{OPENRLHF_DEST}{index}" not in flags:
            continue
        value = flags[f"{OPENRLHF_DEST}{index}"]
        spelled = " / ".join(f"--{name}" for name in flag.spellings(cli))
        if flag.kind == REFUSED and value != flag.default and not (flag.takes == "pair" and
                                                                   tuple(value) == tuple(flag.default or ())):
            raise UserError(f"{spelled} {value!r} is not supported here: {flag.note}.")
        if flag.kind == MAPPED:
            print(f"rlhf: note: {spelled}: {flag.note}.", file=sys.stderr)
        values.update(flag.updates(value))
    nodes, gpus = values.pop("_num_nodes", None), values.pop("_num_gpus_per_node", None)
    if (nodes or gpus) and "num_workers" not in values:
        values["num_workers"] = (nodes or 1) * (gpus or 1)
    return values


def dotted_defaults(cli: str, flags: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """OpenRLHF 0.11's defaults where they differ from 0.9.10's, for the fields `values` (a command line's) leaves
    unset, when that command line spelled any flag the 0.11 way (`flags`, as parsed); said once."""
    spelled = flags.get(DOTTED_SPELLINGS)
    if not spelled:
        return {}
    changed = {flag.field: (flag.dotted_names(cli)[0], flag.dotted_default[cli]) for flag in flags_for(cli)
               if cli in flag.dotted_default and flag.field not in values}
    if changed:
        print(f"rlhf: note: {spelled[0]} is OpenRLHF 0.11's spelling, so 0.11's defaults apply: "
              + ", ".join(f"--{name} {value}" for name, value in changed.values()) + ".", file=sys.stderr)
    return {field: value for field, (_, value) in changed.items()}


def say_departures(cli: str, values: dict[str, Any], run: Any) -> None:
    """One note naming each flag whose default here is not OpenRLHF's, that the command line (its `values`) leaves
    out, where it matters to `run`, with the value it gets; the table (docs/openrlhf-flags.md) says why."""
    section = run.stage_config(cli)
    departed = [f"--{flag.spellings(cli)[0]} {_shown(getattr(section, flag.field, getattr(run, flag.field, None)))}"
                for flag in flags_for(cli) if flag.departure(cli) and flag.field not in values
                and (flag.departs_if is None or flag.departs_if(run))]
    if departed:
        print(f"rlhf: note: defaults that are not OpenRLHF's here (docs/openrlhf-flags.md says why): "
              f"{', '.join(departed)}.", file=sys.stderr)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)
