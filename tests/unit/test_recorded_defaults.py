"""A run started before `rlhf` took OpenRLHF's defaults (issue 44) still resumes: a setting its command leaves out
keeps the value its checkpoints recorded when that was the earlier default (rlhf_core.driver.resume.
keep_recorded_defaults), so the drift check compares what the run recorded, not today's defaults."""

from __future__ import annotations

import pytest

from flows.cli import _own_flags, build_parser, run_config_from_flags
from rlhf_core.config import semantic_fields
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.driver.resume import config_drift, validate_run_start
from rlhf_core.storage.metadata import CheckpointMetadata
from rlhf_core.errors import UserError
from rlhf_core.stages import STAGES
from rlhf_core.storage.checkpoint import CheckpointStore

SFT_FLAGS = ["--pretrain", "m", "--dataset", "d.jsonl", "--train_batch_size", "8", "--micro_train_batch_size", "4",
             "--load_checkpoint"]


def _run(tmp_path, *flags: str):
    args = build_parser().parse_args(["train", "sft", *SFT_FLAGS, "--ckpt_path", str(tmp_path), *flags])
    return resolve_paths(run_config_from_flags("sft", _own_flags(args, "stage")))  # as the CLI's preflight has it


def _commit_as_an_older_version(run, tmp_path, **recorded) -> dict:
    """A committed SFT checkpoint whose metadata records `recorded` over the run's own settings."""
    metadata = {"step": 5, "seed": run.seed, "config": {**semantic_fields(run.sft), **recorded}}
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    (staging / "weights.bin").write_bytes(b"x")
    CheckpointStore(run.stage_url("sft")).commit(5, str(staging), metadata)
    return metadata


def test_a_run_that_recorded_the_earlier_defaults_resumes_with_them(tmp_path, caplog):
    run = _run(tmp_path)
    assert (run.sft.max_epochs, run.sft.max_samples, run.sft.input_template) == (2, 1_000_000, "User: {}\nAssistant: ")
    metadata = _commit_as_an_older_version(run, tmp_path, max_epochs=1, max_samples=None, input_template=None)
    validate_run_start(run)  # not refused as drifted
    assert (run.sft.max_epochs, run.sft.max_samples, run.sft.input_template) == (1, None, None)  # nor changed
    assert config_drift(run, "sft", CheckpointMetadata.from_json(metadata)) == []
    assert caplog.text.count("the run keeps them") == 1 and "max_epochs 1" in caplog.text


def test_a_setting_given_is_still_held_against_the_record(tmp_path):
    run = _run(tmp_path, "--max_epochs", "2")
    _commit_as_an_older_version(run, tmp_path, max_epochs=1)
    with pytest.raises(UserError, match="max_epochs: 1 -> 2"):
        validate_run_start(run)


def test_a_recorded_value_that_was_never_a_default_is_drift_as_before(tmp_path):
    run = _run(tmp_path)
    _commit_as_an_older_version(run, tmp_path, max_epochs=3)
    with pytest.raises(UserError, match="max_epochs: 3 -> 2"):
        validate_run_start(run)


def test_the_earlier_defaults_name_settings_whose_default_changed():
    """Each entry is a semantic setting of its stage whose default now differs (else it is stale or misspelled)."""
    for stage in STAGES.values():
        earlier, fields = stage.config.earlier_defaults, stage.config.model_fields
        for name, value in earlier.items():
            assert name in fields and fields[name].default != value, (stage.name, name)
