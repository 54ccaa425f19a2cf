"""A run config as the user wrote it: the YAML file read into a `RunConfig`, and whatever is wrong with it (or
with the same settings given as CLI flags) said in one sentence naming the file, line and field."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Callable

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.stages import STAGES


def _field_names() -> set[str]:
    """Every setting's name that has an underscore (distinct enough to be spotted inside a message)."""
    models: tuple[type[BaseModel], ...] = (RunConfig, *(stage.config for stage in STAGES.values()))
    return {name for model in models for name in model.model_fields if "_" in name}


def _spell_fields(message: str, prefix: str) -> str:
    """Setting names inside a validator's message as the user writes them: `--name` (a stage's `ppo.name` too,
    on the command line) or `sft.name`."""
    known = _field_names()
    stage = "" if prefix != "--" else rf"(?:(?:{'|'.join(STAGES)})\.)?"

    def spell(found: re.Match) -> str:
        return prefix + found.group(1) if found.group(1) in known else found.group(0)

    return re.sub(rf"(?<![\w.-]){stage}([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w-])", spell, message)


def describe_validation_error(error: ValidationError, source: str, flag_style: bool,
                              line_of: Callable[[tuple], int | None] | None = None) -> str:
    """One sentence naming the offending field (as `--flag` on the CLI, as `a.b` in a file, with the file's
    line when `line_of` can tell it), the value given, what is wrong and, for a misspelt key, the near miss."""
    first = error.errors()[0]
    location = tuple(first["loc"])
    names = [str(part) for part in location if isinstance(part, str)]
    line = line_of(location) if line_of else None
    where = f"{source} line {line}" if line else source
    if flag_style:
        name, prefix = ("--" + names[-1] if names else ""), "--"
    else:
        name, prefix = ".".join(str(part) for part in location), "".join(f"{part}." for part in names)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" and (not location or _model_at(location) is not None):
        name, message = "", _spell_fields(message, prefix)  # a check across fields: they are in the message
    elif first["type"] == "missing":
        message = "is required"
    elif first["type"] == "extra_forbidden":
        message = "is not a known setting"
        model = _model_at(location[:-1])
        near = difflib.get_close_matches(names[-1], list(model.model_fields), n=1) if model and names else []
        if near:
            message += f"; did you mean {prefix.removesuffix(names[-1] + '.')}{near[0]}?"
    elif isinstance(first.get("input"), (str, int, float)) and first["type"] != "value_error":
        message = f"{first['input']!r}: {message[:1].lower()}{message[1:]}"
    more = f" (and {len(error.errors()) - 1} more problem(s))" if len(error.errors()) > 1 else ""
    subject = f"{name} {message}" if name else message
    return f"{where}: {subject}{more}.".replace("?.", "?")


def _model_at(location: tuple) -> type[BaseModel] | None:
    """The config model that holds the field at `location` inside a RunConfig (a stage's, or RunConfig)."""
    if not location:
        return RunConfig
    field = RunConfig.model_fields.get(str(location[0]))
    if len(location) == 1 and field is not None:
        inner = [arg for arg in getattr(field.annotation, "__args__", ()) if isinstance(arg, type)
                 and issubclass(arg, BaseModel)]
        return inner[0] if inner else None
    return None


def yaml_line(text: str, location: tuple) -> int | None:
    """The 1-based line of the YAML key at `location` (a missing key: its nearest parent's line)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in location:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((key, value) for key, value in node.value if key.value == str(part)), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def load_run_config(path: str) -> RunConfig:
    """Read a YAML run config; any problem becomes a UserError naming the file, line and field."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"{path}: cannot read the config file ({error.strerror}).") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(error, 'problem', error)}).") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of settings, not {type(data).__name__}.")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise UserError(describe_validation_error(error, path, flag_style=False,
                                                  line_of=lambda location: yaml_line(text, location))) from None
