"""The OpenRLHF flag table against OpenRLHF's own parsers, our CLI and the docs, so no flag drifts silently.

tests/data/openrlhf/flags.json holds every option of OpenRLHF's CLIs at v0.9.10 and v0.11.0 (extracted with ast),
and dotted_names.json the 0.9 -> 0.11 renames; see tests/data/openrlhf/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import build_parser, main
from flows.openrlhf_flags import COMBINER, FLAGS, IMPLEMENTED, MAPPED, OPENRLHF_MODULES, REFUSED, flags_for, render_markdown

DATA = Path(__file__).parents[1] / "data" / "openrlhf"
REPO = Path(__file__).parents[2]
CLIS = tuple(OPENRLHF_MODULES)
# The commands whose OpenRLHF parsers the reference data holds at v0.9.10 and v0.11.0 (train_prm left OpenRLHF
# before 0.9.10: its v0.9.0 options are checked by test_every_train_prm_option_of_v0_9_0_has_a_row).
REFERENCE_CLIS = tuple(cli for cli in CLIS if OPENRLHF_MODULES[cli] in
                       json.loads((DATA / "flags.json").read_text())["v0.9.10"])
IGNORED = {"help"}


def _options(tag: str, cli: str) -> set[str]:
    flags = json.loads((DATA / "flags.json").read_text())[tag][OPENRLHF_MODULES[cli]]
    return {option["flag"] for option in flags} - IGNORED


def _parser_for(cli: str):
    commands = build_parser()._subparsers._group_actions[0].choices
    if cli == COMBINER:
        return commands["lora-combiner"]
    return commands["train"]._subparsers._group_actions[0].choices[cli]


@pytest.mark.parametrize("tag", ["v0.9.10", "v0.11.0"])
@pytest.mark.parametrize("cli", REFERENCE_CLIS)
def test_every_openrlhf_option_has_a_row(tag, cli):
    spelled = {name for flag in flags_for(cli) for name in flag.spellings(cli)}
    missing = sorted(_options(tag, cli) - spelled)
    assert not missing, f"OpenRLHF {tag} {OPENRLHF_MODULES[cli]} options with no row in flows/openrlhf_flags.py: {missing}"


@pytest.mark.parametrize("cli", REFERENCE_CLIS)
def test_dotted_names_sit_on_the_row_of_their_old_name(cli):
    renames = json.loads((DATA / "dotted_names.json").read_text())[OPENRLHF_MODULES[cli]]
    rows = {flag.name: flag for flag in flags_for(cli) if flag.name}
    for old, entry in renames.items():
        if old in IGNORED or not entry["dotted"]:
            continue
        expected = {entry["dotted"], *entry.get("also", [])}
        assert expected <= set(rows[old].spellings(cli)), f"--{old}: 0.11 spells it {sorted(expected)}"


@pytest.mark.parametrize("cli", CLIS)
def test_every_row_is_a_flag_of_the_command(cli):
    actions = _parser_for(cli)._option_string_actions
    for flag in flags_for(cli):
        for name in flag.spellings(cli):
            assert f"--{name}" in actions, f"--{name} ({flag.kind}) is missing from {cli}'s parser"
            dest = actions[f"--{name}"].dest
            if flag.kind == IMPLEMENTED and flag.convert is None:
                assert dest == flag.field, f"--{name} lands in {dest}, not {flag.field}"


def test_rows_are_well_formed():
    for flag in FLAGS:
        assert flag.kind in (IMPLEMENTED, MAPPED, REFUSED)
        assert flag.name or flag.dotted, flag
        if flag.kind != IMPLEMENTED:
            assert flag.note, f"--{flag.name or flag.dotted}: a {flag.kind} flag must say why"


def test_docs_table_is_generated_from_the_table():
    docs = (REPO / "docs" / "openrlhf-flags.md").read_text()
    assert docs == render_markdown(), "regenerate: python -m flows.openrlhf_flags > docs/openrlhf-flags.md"


SAMPLE = {"switch": [], "pair": ["0.5", "0.7"], "list": ["q_proj"]}


def _sample(flag) -> list[str]:
    if flag.takes in SAMPLE:
        return SAMPLE[flag.takes]
    return ["3" if flag.value_type is int else "0.5" if flag.value_type is float else "something"]


@pytest.mark.parametrize("flag", [flag for flag in FLAGS if flag.kind == REFUSED and "ppo" in flag.clis],
                         ids=lambda flag: flag.name or str(flag.dotted))
def test_refused_flags_exit_2_with_the_reason(flag, capsys):
    spelling = flag.spellings("ppo")[-1]
    assert main(["train", "ppo", f"--{spelling}", *_sample(flag)]) == 2
    err = capsys.readouterr().err
    assert flag.note in " ".join(err.split()) and "Traceback" not in err, err


def test_mapped_flags_print_one_note_and_set_what_they_map(capsys):
    from flows.cli import _own_flags
    from flows.cli_flags import apply_openrlhf_flags
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig

    args = build_parser().parse_args(["train", "ppo", "--colocate_actor_ref", "--actor.num_nodes", "2",
                                      "--actor_num_gpus_per_node", "2", "--actor_learning_rate", "3e-4",
                                      "--generate_max_len", "7", "--bf16", "--ref_num_nodes", "1"])
    values = apply_openrlhf_flags("ppo", _own_flags(args, "stage"),
                                  (RunConfig, PPOConfig), {"stages", "sft", "rm", "ppo", "merge", "export"})
    assert values == {"num_workers": 4, "learning_rate": 3e-4, "max_new_tokens": 7, "param_dtype": "bf16"}
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 7 and sum("--colocate_actor_ref" in line for line in notes) == 1, notes


def test_wandb_key_goes_to_the_environment_not_the_config(monkeypatch):
    from flows.cli import _own_flags
    from flows.cli_flags import apply_openrlhf_flags
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = build_parser().parse_args(["train", "ppo", "--logger.wandb.key", "secret-key-123"])
    values = apply_openrlhf_flags("ppo", _own_flags(args, "stage"),
                                  (RunConfig, PPOConfig))
    import os

    assert values == {"use_wandb": True} and os.environ["WANDB_API_KEY"] == "secret-key-123"
