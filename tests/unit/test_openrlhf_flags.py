"""The OpenRLHF flag table against OpenRLHF's own parsers, our CLI and the docs, so no flag drifts silently.

tests/data/openrlhf/flags.json holds every option of OpenRLHF's CLIs at v0.9.10 and v0.11.0, and of train_prm at
v0.9.0 (extracted with ast), and dotted_names.json the 0.9 -> 0.11 renames; see tests/data/openrlhf/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import build_parser, main
from flows.openrlhf_flags import (COMBINER, FLAGS, IMPLEMENTED, MAPPED, OPENRLHF_MODULES, PRM, REFUSED, flags_for,
                                  render_markdown)

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


def test_every_train_prm_option_of_v0_9_0_has_a_row():
    """train_prm left OpenRLHF after v0.9.5, so the reference data holds it at v0.9.0 only."""
    assert OPENRLHF_MODULES[PRM] == "train_prm"
    spelled = {name for flag in flags_for(PRM) for name in flag.spellings(PRM)}
    options = _options("v0.9.0", PRM)
    assert len(options) == 60
    missing = sorted(options - spelled)
    assert not missing, f"OpenRLHF v0.9.0 train_prm options with no row in flows/openrlhf_flags.py: {missing}"


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


def test_openrlhf_v0_9_0_prm_script_flags_land_in_prm_fields(tmp_path, capsys):
    """OpenRLHF v0.9.0's examples/scripts/train_prm_mistral.sh (a byte-identical copy), with only its paths edited
    (nothing is loaded: the model and data paths do not exist), parses as `rlhf train prm` and each flag lands in
    its field."""
    from flows.cli import _own_flags, run_config_from_flags
    from tests.integration.openrlhf_scripts import ScriptEdits, changed_flags, edit_command, parse_script

    script = parse_script(DATA / "v0.9.0" / "train_prm_mistral.sh")
    assert script.module == "openrlhf.cli.train_prm"
    known = {name for flag in flags_for(PRM) for name in flag.spellings(PRM)}
    assert set(script.flags) <= known, sorted(set(script.flags) - known)
    paths = {"pretrain": str(tmp_path / "no-such-model"), "dataset": str(tmp_path / "no-such-data.jsonl"),
             "save_path": str(tmp_path / "out")}
    edited = edit_command(script, ScriptEdits("train_prm", ("rlhf", "train", PRM),
                                              {flag: (path,) for flag, path in paths.items()}), "v0.9.0")
    assert changed_flags(script, edited) == set(paths)

    args = build_parser().parse_args(edited.argv()[1:])
    run = run_config_from_flags(PRM, _own_flags(args, "stage"))
    prm = run.prm
    assert (prm.placeholder_token, prm.reward_tokens) == ("ки", ["+", "-"])
    assert (prm.input_key, prm.label_key) == ("input", "value")
    assert prm.packing_samples is True and prm.zero_stage == 3 and prm.gradient_checkpointing is True
    assert (prm.pretrain, prm.dataset, prm.save_path) == (paths["pretrain"], paths["dataset"], paths["save_path"])
    assert (prm.learning_rate, prm.max_len, prm.max_epochs) == (1e-6, 8192, 1)
    assert (prm.train_batch_size, prm.micro_train_batch_size) == (256, 8)
    assert (prm.save_steps, prm.eval_steps, prm.logging_steps) == (500, 100, 1)
    assert (prm.param_dtype, prm.attn_implementation) == ("bf16", "flash_attention_2")  # --bf16: mapped
    assert run.load_checkpoint is True and run.wandb_group == "prm" and run.stages == [PRM]
    assert capsys.readouterr().err.count("rlhf: note: --bf16:") == 1


def test_train_prm_flags_have_no_invented_dotted_spelling():
    """train_prm never reached OpenRLHF 0.11: the rows PRM shares with other commands give it only their 0.9
    names, and the other commands keep their dotted ones."""
    rows = {flag.name: flag for flag in flags_for(PRM)}
    for name in ("save_path", "learning_rate", "use_liger_kernel", "dataset", "dataset_probs", "dataset_split",
                 "input_key", "label_key", "placeholder_token", "reward_tokens"):
        assert rows[name].spellings(PRM) == [name]
    assert rows["label_key"].spellings("ppo") == ["label_key", "data.label_key"]
    assert rows["input_key"].spellings("sft") == ["input_key", "data.input_key"]
