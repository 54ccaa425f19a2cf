"""The drift guard sees a stage's input models change under the same path (e.g. SFT retrained into
the folder RM started from), but not a copy, a touch, or a re-export of the same checkpoint."""

from __future__ import annotations

import json
import os

from rlhf_core.config import RunConfig, semantic_fields
from rlhf_core.stages.rm import RMConfig
from rlhf_core.storage.locate import SOURCE_NAME, input_model_fingerprints, model_fingerprint
from rlhf_core.driver.resume import config_drift
from rlhf_core.storage.metadata import CheckpointMetadata


def write_model(directory, weights: bytes, source_digest: str | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(weights)
    if source_digest:
        (directory / SOURCE_NAME).write_text(json.dumps({"checkpoint": "x/step_4", "manifest_digest": source_digest}))
    return str(directory)


def test_fingerprint_of_an_exported_stage_output_is_its_checkpoint(tmp_path):
    model = write_model(tmp_path / "sft", b"a" * 10, source_digest="d1")
    assert model_fingerprint(model) == "checkpoint:d1"
    write_model(tmp_path / "sft", b"b" * 10, source_digest="d2")
    assert model_fingerprint(model) == "checkpoint:d2"


def test_fingerprint_of_another_model_is_its_file_sizes_not_their_times(tmp_path):
    model = write_model(tmp_path / "base", b"a" * 10)
    before = model_fingerprint(model)
    os.utime(tmp_path / "base" / "model.safetensors", (1, 1))
    assert model_fingerprint(model) == before
    write_model(tmp_path / "base", b"a" * 11)
    assert model_fingerprint(model) != before
    assert model_fingerprint(str(tmp_path / "missing")) == ""


def test_drift_names_the_input_model_that_changed(tmp_path, toy_assets):
    model = write_model(tmp_path / "sft", b"a" * 10, source_digest="d1")
    run = RunConfig(stages=["rm"], rm=RMConfig(pretrain=model, dataset=toy_assets["prefs"]))
    record = {"config": semantic_fields(run.rm), "seed": run.seed, "input_models": input_model_fingerprints(run.rm)}
    assert config_drift(run, "rm", CheckpointMetadata.from_json(record)) == []
    write_model(tmp_path / "sft", b"a" * 10, source_digest="d2")
    assert config_drift(run, "rm", CheckpointMetadata.from_json(record)) == ["pretrain model contents: changed"]
    before_the_check = CheckpointMetadata.from_json({**record, "input_models": {}})
    assert config_drift(run, "rm", before_the_check) == []
