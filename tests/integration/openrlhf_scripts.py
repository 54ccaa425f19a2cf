"""OpenRLHF's example launch scripts as data: parse the command they run, and apply the few edits a user may
make to run them here (launcher, paths, sizes, GPU and engine counts), nothing else.

`parse_script` reads the bash text the way bash would build the command: comments dropped, `\\`-newline
continuations joined, the `read -r -d '' training_commands <<EOF ... EOF` body substituted (unquoted, so split
on whitespace) into the line that runs `$training_commands`, or the single command line otherwise (quoted as
bash quotes, via shlex). The command splits into the launcher (everything up to the `openrlhf.cli.*` module:
`deepspeed --module`, `ray job submit ... -- python3 -m`, `python3 -m`) and the module's arguments, grouped into
`(flag, values)` options in order. Variables the script sets before its command (`NUM_GPUS=${1:-8}`, `export
NAME=value`) are expanded in it as bash would with no arguments given (`$((NUM_GPUS))` -> 8).

`edit_command` applies one script's `ScriptEdits`: a new launcher and new values for named flags. Flags are named
by their OpenRLHF 0.9 spelling; a 0.11 script's dotted spelling is looked up in
tests/data/openrlhf/dotted_names.json (OpenRLHF's own rename, extracted from its history), so one edit table
serves every release. An edit of a flag the script does not have is an error, and `changed_flags` tells which
flags differ between two commands, so a test can prove nothing was dropped, added or quietly changed.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "openrlhf"
RELEASES = ("v0.9.10", "v0.11.0")
DOTTED_RELEASES = ("v0.11.0",)  # releases whose flags are dotted (0.10 on); v0.9.0 and v0.9.10 are flat
ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(\S*)$")
HEREDOC_START = re.compile(r"^read\s+-r\s+-d\s+''\s+(\w+)\s+<<\s*(\w+)\s*$")


@dataclass(frozen=True)
class Command:
    """One parsed launch: `launcher` (e.g. deepspeed --module), `module` (openrlhf.cli.train_sft; "" once the
    launcher is ours and ends with the command) and the options as (flag without dashes, values) in order."""

    launcher: tuple[str, ...]
    module: str
    options: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def flags(self) -> list[str]:
        return [flag for flag, _ in self.options]

    def value(self, flag: str) -> tuple[str, ...]:
        return dict(self.options)[flag]

    def arguments(self) -> list[str]:
        """The module's arguments as argv words."""
        return [word for flag, values in self.options for word in (f"--{flag}", *values)]

    def argv(self) -> list[str]:
        return [*self.launcher, *([self.module] if self.module else []), *self.arguments()]


def _logical_lines(text: str) -> list[str]:
    """Lines with `\\`-newline continuations joined (bash removes them, also inside an unquoted heredoc)."""
    return text.replace("\\\n", "").splitlines()


def _command_words(text: str) -> list[str]:
    """The words of the script's one command: the heredoc form's substituted line, else its one command line."""
    lines = _logical_lines(text)
    for index, line in enumerate(lines):
        heredoc = HEREDOC_START.match(line.strip())
        if heredoc:
            variable, terminator = heredoc.groups()
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == terminator)
            body = " ".join(lines[index + 1:end]).split()  # $var unquoted: word splitting only
            runner = next(line.strip() for line in lines[end + 1:]
                          if f"${variable}" in line and not line.strip().startswith("#"))
            words = shlex.split(runner)
            at = words.index(f"${variable}")
            return [*words[:at], *body, *words[at + 1:]]
    commands = [line.strip() for line in lines
                if line.strip() and not line.strip().startswith("#") and line.strip() != "set -x"]
    variables = {}  # `NUM_GPUS=${1:-8}`, `export NAME=value`: the script run without arguments
    for line in [line for line in commands if ASSIGNMENT.match(line)]:
        name, value = ASSIGNMENT.match(line).groups()
        default = re.fullmatch(r"\$\{\d+:-([^}]*)\}", value)
        variables[name] = default.group(1) if default else shlex.split(value)[0]
        commands.remove(line)
    if len(commands) != 1:
        raise ValueError(f"expected one command in the script, found {len(commands)}: {commands}")
    expanded = re.sub(r"\$\(\((\w+)\)\)|\$\{(\w+)\}", lambda m: variables[m.group(1) or m.group(2)], commands[0])
    return shlex.split(expanded, comments=True)


def parse_command(words: list[str]) -> Command:
    """Split argv words at the `openrlhf.cli.*` module into launcher, module and options; a word starting with
    `--` opens an option, the words after it are its values."""
    at = next(i for i, word in enumerate(words) if word.startswith("openrlhf.cli."))
    launcher, module, rest = tuple(words[:at]), words[at], words[at + 1:]
    options: list[tuple[str, list[str]]] = []
    for word in rest:
        if word.startswith("--"):
            options.append((word[2:], []))
        elif options:
            options[-1][1].append(word)
        else:
            raise ValueError(f"{word!r} comes before any flag of {module}")
    return Command(launcher, module, tuple((flag, tuple(values)) for flag, values in options))


def parse_script(path: Path) -> Command:
    return parse_command(_command_words(path.read_text()))


def dotted_name(cli: str, flag: str) -> str | None:
    """OpenRLHF 0.11's spelling of the 0.9 flag `flag` of `cli` (train_sft, train_rm, train_ppo_ray)."""
    names = json.loads((DATA_DIR / "dotted_names.json").read_text())
    return names[cli][flag]["dotted"]


@dataclass(frozen=True)
class ScriptEdits:
    """The edits allowed for one script: the launcher, and new values of flags named by their 0.9 spelling."""

    cli: str  # OpenRLHF's module name: train_sft, train_rm, train_ppo_ray
    launcher: tuple[str, ...]  # the whole new launcher, ending with `rlhf train STAGE`
    values: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def spelled(self, flag: str, release: str) -> str:
        return dotted_name(self.cli, flag) if release in DOTTED_RELEASES else flag


def edit_command(command: Command, edits: ScriptEdits, release: str) -> Command:
    """`command` with the launcher replaced and each edited flag's values replaced in place (order kept)."""
    if command.module != f"openrlhf.cli.{edits.cli}":
        raise ValueError(f"the script runs {command.module}, the edits are for openrlhf.cli.{edits.cli}")
    wanted = {edits.spelled(flag, release): values for flag, values in edits.values.items()}
    missing = set(wanted) - set(command.flags)
    if missing:
        raise ValueError(f"edits name flags the script does not have: {sorted(missing)}")
    options = tuple((flag, wanted.get(flag, values)) for flag, values in command.options)
    return replace(command, launcher=edits.launcher, module="", options=options)


def changed_flags(original: Command, edited: Command) -> set[str]:
    """Flags whose values differ; raises when the two commands do not have the same flags in the same order."""
    if original.flags != edited.flags:
        raise AssertionError(f"the flags differ: only in the script {sorted(set(original.flags) - set(edited.flags))}, "
                             f"only in the edited command {sorted(set(edited.flags) - set(original.flags))}, "
                             f"or their order changed")
    return {flag for (flag, before), (_, after) in zip(original.options, edited.options) if before != after}
