"""The OpenRLHF flag table against OpenRLHF's own parsers, our CLI and the docs, so no flag drifts silently.

tests/data/openrlhf/flags.json holds every option of OpenRLHF's CLIs at v0.9.10 and v0.11.0, and of train_prm at
v0.9.0 (extracted with ast), and dotted_names.json the 0.9 -> 0.11 renames; see tests/data/openrlhf/README.md.
"""

from __future__ import annotations

import ast
import json
import re
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


# --------------------------------------------------------------------------------------------------- defaults
# Every flag's default here is OpenRLHF's (v0.9.10's; 0.11's for a command line with a dotted spelling; train_prm's
# v0.9.0's), or its row says why not (`Flag.departs`). The defaults are read from what `rlhf train` builds for a
# command line that gives only the required flags, so the CLI's own rules (0.11's defaults) are held too.

EXCLUDED: set[str] = set()  # every default is held, the evaluation settings too
# The flags each command needs (OpenRLHF's None there means "give it"), by field.
REQUIRED = {"sft": {"pretrain": "m", "dataset": "d.jsonl"}, "rm": {"pretrain": "m", "dataset": "d.jsonl"},
            "dpo": {"pretrain": "m", "dataset": "d.jsonl"},
            "ppo": {"pretrain": "m", "prompt_data": "p.jsonl", "remote_rm_url": "reward.py"},
            "prm": {"pretrain": "m", "dataset": "d.jsonl", "placeholder_token": "ки"}}
# OpenRLHF defaults that our field spells otherwise, with the same effect: field -> (OpenRLHF's values, ours).
SAME_MEANING = {
    "max_ckpt_mem": ({1e8, float("inf")}, None),  # 1e8 GB (PPO: inf) keeps every checkpoint, as no limit (None)
    "vllm_num_engines": ({None}, 0),  # None starts no vLLM engine ("set to 0 to disable vLLM"), as 0
    "use_wandb": ({None}, False),  # no wandb key: nothing goes to wandb
}
# OpenRLHF's None there means another flag's model, and ours is filled from that flag the same way: DPO's reference
# is the policy's --pretrain; a gae critic starts from the reward model, or from the actor when a function rewards.
FROM_ANOTHER_FLAG = {"ref_pretrain": "pretrain", "critic_pretrain": "pretrain"}
GENERATIONS = [(cli, tag) for cli in REFERENCE_CLIS if cli != COMBINER for tag in ("v0.9.10", "v0.11.0")] + \
              [(PRM, "v0.9.0")]


def _openrlhf_default(option: dict):
    """An option's default as OpenRLHF's parser holds it (flags.json keeps the source text)."""
    text = option["default"]
    if text is None:
        return {"store_true": False, "store_false": True}.get(option["action"])
    try:
        return ast.literal_eval(text)
    except ValueError:
        called = re.fullmatch(r"(int|float)\((.*)\)", text)  # int(1e8), float('inf')
        return {"int": int, "float": float}[called[1]](ast.literal_eval(called[2])) if called else text


def _what_we_make_of(flag, value) -> dict:
    """The config values a command line giving `value` for this flag sets here."""
    if value is None or flag.convert is None:
        return {flag.field: value} if flag.field else {}
    if flag.takes == "list" and isinstance(value, str):
        value = [value]
    return {name: given for name, given in flag.updates(value).items() if not name.startswith("_")}


def _run_with_only_required_flags(cli: str, dotted: bool):
    from flows.cli import _own_flags, run_config_from_flags

    argv = ["train", cli]
    for field, value in REQUIRED[cli].items():
        row = next(flag for flag in flags_for(cli) if flag.kind == IMPLEMENTED and flag.field == field)
        argv += [f"--{(row.dotted_names(cli) if dotted else [row.name])[0]}", value]
    return run_config_from_flags(cli, _own_flags(build_parser().parse_args(argv), "stage"))


def _ours(run, cli: str, field: str):
    section = run.stage_config(cli)
    return getattr(section, field) if field in type(section).model_fields else getattr(run, field)


def _same(field: str, theirs, ours, cli: str = "") -> bool:
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        return list(theirs) == list(ours)
    if theirs is None and field in FROM_ANOTHER_FLAG:
        return ours == REQUIRED[cli][FROM_ANOTHER_FLAG[field]]
    spelled, as_here = SAME_MEANING.get(field, (set(), object()))
    return theirs == ours or (theirs in spelled and ours == as_here)


def _defaults_compared(cli: str, tag: str, capsys) -> list[tuple]:
    """(flag, spelling, field, OpenRLHF's default, ours) for every flag of `cli` OpenRLHF `tag` has."""
    dotted = tag == "v0.11.0"
    run = _run_with_only_required_flags(cli, dotted)
    capsys.readouterr()  # the departures' notes
    options = {option["flag"]: option for option in json.loads((DATA / "flags.json").read_text())[tag][
        OPENRLHF_MODULES[cli]]}
    compared = []
    for flag in flags_for(cli):
        if flag.kind == REFUSED:
            continue
        for name in (flag.dotted_names(cli) if dotted else [flag.name]):
            if name not in options:
                continue
            for field, theirs in _what_we_make_of(flag, _openrlhf_default(options[name])).items():
                if field not in EXCLUDED and field not in REQUIRED[cli]:
                    compared.append((flag, name, field, theirs, _ours(run, cli, field)))
    return compared


@pytest.mark.parametrize("cli, tag", GENERATIONS)
def test_every_default_is_openrlhfs_or_a_departure_with_its_reason(cli, tag, capsys):
    compared = _defaults_compared(cli, tag, capsys)
    assert len(compared) > 30
    wrong = [f"--{name} ({field}): OpenRLHF {theirs!r}, here {ours!r}" for flag, name, field, theirs, ours in compared
             if not _same(field, theirs, ours, cli) and not flag.departure(cli)]
    assert not wrong, f"rlhf train {cli}'s defaults that are not OpenRLHF {tag}'s and no row says why: {wrong}"


@pytest.mark.parametrize("cli", [cli for cli, _ in GENERATIONS[::2]] + [PRM])
def test_a_departure_is_a_real_one(cli, capsys):
    """A row marked as departing from OpenRLHF's default does differ from it (else the mark and its note mislead)."""
    compared = [entry for tag in (tag for each, tag in GENERATIONS if each == cli)
                for entry in _defaults_compared(cli, tag, capsys)]
    differing = {flag.name or str(flag.dotted) for flag, _, field, theirs, ours in compared
                 if not _same(field, theirs, ours, cli)}
    marked = {flag.name or str(flag.dotted) for flag in flags_for(cli) if flag.departure(cli)}
    assert marked <= differing, f"marked as departures but equal to OpenRLHF's: {sorted(marked - differing)}"


@pytest.mark.parametrize("tag", ["v0.9.10", "v0.11.0"])
def test_refused_flags_accept_openrlhfs_default(tag):
    """A script that gives a refused flag at OpenRLHF's default is accepted: the row's default is OpenRLHF's."""
    wrong = []
    for cli in REFERENCE_CLIS:
        options = {option["flag"]: option for option in json.loads((DATA / "flags.json").read_text())[tag][
            OPENRLHF_MODULES[cli]]}
        for flag in (flag for flag in flags_for(cli) if flag.kind == REFUSED):
            for name in (flag.dotted_names(cli) if tag == "v0.11.0" else [flag.name]):
                if name in options and not _same("", _openrlhf_default(options[name]), flag.default):
                    wrong.append(f"{cli} --{name}: {_openrlhf_default(options[name])!r} vs {flag.default!r}")
    assert not wrong, wrong


def test_a_departure_is_said_once_when_the_command_leaves_the_flag_out(capsys):
    from flows.cli import _own_flags, run_config_from_flags

    run = _run_with_only_required_flags("sft", dotted=False)
    notes = [line for line in capsys.readouterr().err.splitlines() if "not OpenRLHF's" in line]
    assert len(notes) == 1 and notes[0].startswith("rlhf: note:") and run.sft.param_dtype == "fp32"
    assert notes[0].count("--param_dtype fp32") == 1 and "docs/openrlhf-flags.md" in notes[0]
    assert "--wandb_project" not in notes[0]  # it departs only where it matters: with --use_wandb
    given = build_parser().parse_args(["train", "sft", "--pretrain", "m", "--dataset", "d", "--param_dtype", "bf16"])
    run_config_from_flags("sft", _own_flags(given, "stage"))
    assert "--param_dtype" not in capsys.readouterr().err


def test_a_dotted_spelling_anywhere_selects_0_11s_defaults(capsys):
    """OpenRLHF 0.11 changed PPO's micro batch sizes (8 and 4 -> 1 and 1): a command line that spells any flag the
    0.11 way gets 0.11's, one in 0.9's spellings only gets 0.9.10's, and a value given wins over either."""
    from flows.cli import _own_flags, run_config_from_flags

    def ppo(*argv: str):
        args = build_parser().parse_args(["train", "ppo", "--pretrain", "m", "--remote_rm_url", "r.py", *argv])
        section = run_config_from_flags("ppo", _own_flags(args, "stage")).ppo
        return section.micro_train_batch_size, section.micro_rollout_batch_size

    assert ppo("--prompt_data", "p.jsonl") == (4, 8)
    assert ppo("--data.prompt_dataset", "p.jsonl") == (1, 1)
    assert ppo("--data.prompt_dataset", "p.jsonl", "--micro_train_batch_size", "2") == (2, 1)
    assert ppo("--prompt_data", "p.jsonl", "--rollout.micro_batch_size", "16") == (1, 16)
    assert "0.11" in capsys.readouterr().err
