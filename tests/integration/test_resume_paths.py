"""Resume paths on a real local Ray with real DeepSpeed, driven through rlhf_core (no Prefect):
corruption fallback, config drift, world-size change, pickle refusal, --resume_from, --load_weights_only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.storage.manifest import MANIFEST_NAME, Manifest, ManifestEntry, digest_of_local_file
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.errors import UnsafeCheckpoint, UserError
from rlhf_core.driver.resume import Lineage, begin_stage, validate_run_start
from tests.integration.chunks import train_chunks

pytestmark = pytest.mark.slow
HF_WEIGHTS = Path("actor_model") / "hf" / "model.safetensors"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield
    import ray

    ray.shutdown()


def make_run(toy, ckpt: Path, **overrides) -> RunConfig:
    sft = {"pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
           "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 1, "learning_rate": 1e-3,
           "save_steps": 5, **overrides.pop("sft", {})}
    settings = {"ckpt_path": str(ckpt), "max_ckpt_num": 0, "load_checkpoint": True, **overrides}
    return RunConfig(sft=SFTConfig(**sft), **settings)


def train(run: RunConfig, *targets: int) -> None:
    """Chunks to each target on one worker group; every call starts from the store, not from a warm group."""
    train_chunks(run, "sft", *targets, lineage=begin_stage(run, "sft"))


def weights(run: RunConfig, step: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(run.stage_url("sft"), f"step_{step}", HF_WEIGHTS))


def assert_same(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        diff = (actual[name] - expected[name]).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff} > {atol}"


@pytest.fixture(scope="module")
def reference(toy_assets, tmp_path_factory) -> RunConfig:
    """One uninterrupted single-rank run to step 20, every checkpoint kept."""
    run = make_run(toy_assets, tmp_path_factory.mktemp("reference"))
    train(run, 5, 10, 15, 20)
    return run


def copy_checkpoints(reference: RunConfig, run: RunConfig, *steps: int) -> None:
    """Give `run` the reference's committed checkpoints (same settings, so bit-identical to training
    them again), which saves a worker group start per test."""
    source, target = Path(reference.stage_url("sft")), Path(run.stage_url("sft"))
    target.mkdir(parents=True, exist_ok=True)
    for step in steps:
        shutil.copytree(source / f"step_{step}", target / f"step_{step}")
    (target / "latest").write_text(f"step_{max(steps)}")


def corrupt(step_dir: Path, kind: str) -> None:
    shard = step_dir / "actor_model" / "ds" / "mp_rank_00_model_states.pt"
    if kind == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif kind == "flip_byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif kind == "delete_shard":
        shard.unlink()
    elif kind == "garble_manifest":
        (step_dir / MANIFEST_NAME).write_text("{not json")
    elif kind == "dangling_latest":
        (step_dir.parent / "latest").write_text("step_99")


@pytest.mark.parametrize("kind", ["truncate", "flip_byte", "delete_shard", "garble_manifest", "dangling_latest"])
def test_corrupt_newest_checkpoint_falls_back_to_previous(kind, toy_assets, reference, tmp_path, caplog):
    run = make_run(toy_assets, tmp_path)
    copy_checkpoints(reference, run, 5, 10)
    step_10 = Path(run.stage_url("sft")) / "step_10"
    corrupt(step_10, kind)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.driver.resume"):
        train_chunks(run, "sft", 15)
    if kind != "dangling_latest":
        assert any("skipping checkpoint step_10" in record.getMessage() for record in caplog.records)
        aside = list((Path(run.stage_url("sft")) / ".aside").glob("step_10.*"))
        assert len(aside) == 1 and (aside[0] / "REASON.txt").exists()  # set aside, not deleted
    assert_same(weights(run, 15), weights(reference, 15))


def test_changed_batch_size_is_refused_with_a_diff_but_logging_steps_is_not(toy_assets, reference, tmp_path):
    run = make_run(toy_assets, tmp_path)
    copy_checkpoints(reference, run, 5)
    changed = make_run(toy_assets, tmp_path, sft={"train_batch_size": 16, "micro_train_batch_size": 4})
    with pytest.raises(UserError, match=r"train_batch_size: 8 -> 16.*--allow_config_change"):
        validate_run_start(changed)
    validate_run_start(make_run(toy_assets, tmp_path, sft={"logging_steps": 50}, max_ckpt_num=2))
    validate_run_start(changed.model_copy(update={"allow_config_change": True}))


@pytest.mark.parametrize(("first", "second"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size(first, second, toy_assets, reference, tmp_path):
    train(make_run(toy_assets, tmp_path, num_workers=first), 5, 10)
    run = make_run(toy_assets, tmp_path, num_workers=second)
    [result] = train_chunks(run, "sft", 20)
    assert result.num_steps_trained == 10
    metadata = json.loads((Path(run.stage_url("sft")) / "step_20" / "training_metadata.json").read_text())
    assert metadata["world_size"] == second
    assert metadata["zero_stage"] == (0 if first == 1 else 2)  # the line keeps the layout it began with
    expected = json.loads((Path(reference.stage_url("sft")) / "step_20" / "training_metadata.json").read_text())
    assert abs(metadata["metrics"]["loss"] - expected["metrics"]["loss"]) < 1e-3  # loss of step 20
    assert_same(weights(run, 20), weights(reference, 20), atol=1e-3)


def test_planted_pickle_payload_is_refused_and_not_executed(toy_assets, reference, tmp_path):
    run = make_run(toy_assets, tmp_path)
    copy_checkpoints(reference, run, 5)
    step_dir = Path(run.stage_url("sft")) / "step_5"
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    shard = step_dir / "actor_model" / "ds" / "mp_rank_00_model_states.pt"
    torch.save({"module": Payload()}, shard)
    # An attacker with write access also fixes the manifest, so integrity checks pass.
    manifest = Manifest.from_bytes((step_dir / MANIFEST_NAME).read_bytes())
    files = tuple(ManifestEntry(e.path, shard.stat().st_size, digest_of_local_file(str(shard), e.checksum)[1],
                                e.checksum)
                  if e.path.endswith("mp_rank_00_model_states.pt") else e for e in manifest.files)
    (step_dir / MANIFEST_NAME).write_bytes(Manifest(manifest.step, files).to_bytes())
    with pytest.raises(UnsafeCheckpoint, match=r"mp_rank_00_model_states.pt .*it would call posix.system"):
        train_chunks(run, "sft", 10)
    assert not marker.exists()


def test_resume_from_an_older_step_sets_newer_ones_aside(toy_assets, reference, tmp_path):
    copy_checkpoints(reference, make_run(toy_assets, tmp_path), 5, 10, 15)
    run = make_run(toy_assets, tmp_path / "rlhf" / "sft" / "step_5")  # OpenRLHF style: --ckpt_path .../step_5
    assert run.resume_from == 5 and run.ckpt_path == str(tmp_path)
    validate_run_start(run)
    train(run, 10)
    stage_dir = Path(run.stage_url("sft"))
    assert sorted(p.name for p in stage_dir.glob("step_*")) == ["step_10", "step_5"]
    assert len(list((stage_dir / ".aside").glob("step_*"))) == 2
    assert_same(weights(run, 10), weights(reference, 10))
    assert begin_stage(run, "sft") == Lineage(5, begin_stage(run, "sft").start_digest)  # same branch: kept
    assert (stage_dir / "step_10").exists()


def test_load_weights_only_restarts_the_optimizer_but_not_the_schedule(toy_assets, reference, tmp_path):
    copy_checkpoints(reference, make_run(toy_assets, tmp_path), 5)
    run = make_run(toy_assets, tmp_path, load_weights_only=True)
    lineage = begin_stage(run, "sft")
    assert lineage.weights_only and lineage.start_step == 5
    train_chunks(run, "sft", 10, lineage=lineage)
    metadata = json.loads((Path(run.stage_url("sft")) / "step_10" / "training_metadata.json").read_text())
    expected = json.loads((Path(reference.stage_url("sft")) / "step_10" / "training_metadata.json").read_text())
    assert metadata["metrics"]["lr"] == pytest.approx(expected["metrics"]["lr"])
    with pytest.raises(AssertionError):  # fresh Adam moments: not the fully resumed weights
        assert_same(weights(run, 10), weights(reference, 10), atol=1e-7)


def test_a_chunk_whose_checkpoint_retention_removed_is_never_trained_again(toy_assets, reference, tmp_path):
    """With max_ckpt_num 1 only the newest commit stays. Asking again for an earlier chunk (a loop over the plan
    run again, or a flow whose Prefect cache is gone) must train nothing: its work is inside the later commit.
    It used to train steps 1-5 again from the pretrained model and commit a stale step_5 beside step_10."""
    run = make_run(toy_assets, tmp_path, max_ckpt_num=1)
    copy_checkpoints(reference, run, 10)
    [result] = train_chunks(run, "sft", 5, lineage=begin_stage(run, "sft"))
    assert result.num_steps_trained == 0 and result.uri.rstrip("/").endswith("step_10"), result
    assert sorted(p.name for p in Path(run.stage_url("sft")).glob("step_*")) == ["step_10"]
