"""Run-level rules of rlhf_core.driver.chunk: chunk layout, refusing to overwrite a run, path resolution."""

from __future__ import annotations


import pytest

from flows.cli import main
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.driver.plan import plan_stage, resolve_paths
from rlhf_core.driver.resume import validate_run_start
from rlhf_core.config import RunConfig, semantic_fields
from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.errors import UserError


def toy_run(toy_assets, **overrides) -> RunConfig:
    settings = {"pretrain": toy_assets["model"], "dataset": toy_assets["sft"], "input_key": "prompt",
                "output_key": "response", "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4,
                "max_epochs": 1}  # the plans below count one pass (OpenRLHF's SFT default is 2)
    sft = SFTConfig(**{**settings, **overrides.pop("sft", {})})
    return RunConfig(sft=sft, **overrides)


def test_chunks_end_at_every_save_steps_and_at_the_last_step(toy_assets):
    plan = plan_stage(toy_run(toy_assets, sft={"save_steps": 5}), "sft")
    assert plan.num_samples == 256 and plan.total_steps == 32
    assert plan.targets == [5, 10, 15, 20, 25, 30, 32]
    assert plan_stage(toy_run(toy_assets), "sft").targets == [32]  # save_steps -1: one chunk
    assert plan_stage(toy_run(toy_assets, sft={"max_epochs": 2, "save_steps": 40}), "sft").targets == [40, 64]


def test_batch_larger_than_dataset_is_a_user_error(toy_assets):
    with pytest.raises(UserError, match="--train_batch_size 512 is larger than the 256 usable samples"):
        plan_stage(toy_run(toy_assets, sft={"train_batch_size": 512, "micro_train_batch_size": 8}), "sft")


def test_existing_run_is_refused_without_load_checkpoint(toy_assets, tmp_path, capsys):
    run = toy_run(toy_assets, ckpt_path=str(tmp_path))
    validate_run_start(run)  # empty: fine
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "weights.bin").write_bytes(b"x")
    metadata = {"step": 5, "seed": run.seed, "config": semantic_fields(run.sft)}
    CheckpointStore(run.stage_url("sft")).commit(5, str(staging), metadata)
    with pytest.raises(UserError, match="already holds checkpoints; pass --load_checkpoint"):
        validate_run_start(run)
    validate_run_start(run.model_copy(update={"load_checkpoint": True}))
    code = main(["train", "sft", "--pretrain", toy_assets["model"], "--dataset", toy_assets["sft"],
                 "--ckpt_path", str(tmp_path)])
    assert code == 2 and "pass --load_checkpoint" in capsys.readouterr().err
    assert CheckpointStore(run.stage_url("sft")).newest_valid().step == 5  # nothing lost


def test_relative_paths_become_absolute_for_workers(toy_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    run = resolve_paths(RunConfig(ckpt_path="ckpt", stages=["sft", "rm"],
                                  sft=SFTConfig(pretrain="m", dataset="s3://b/d.jsonl,local.jsonl", save_path="out"),
                                  rm=RMConfig(dataset="org/prefs")))
    assert run.ckpt_path == str(tmp_path / "ckpt") and run.sft.pretrain == str(tmp_path / "m")
    assert run.sft.dataset == f"s3://b/d.jsonl,{tmp_path / 'local.jsonl'}"
    # a stage's output feeds the next as a path even before it exists; names that are not paths stay hub ids
    assert run.rm.pretrain == run.sft.save_path == str(tmp_path / "out") and run.rm.dataset == "org/prefs"
    hub = resolve_paths(RunConfig(sft=SFTConfig(pretrain="OpenRLHF/Llama-3-8b-sft-mixture", dataset="d.jsonl")))
    assert hub.sft.pretrain == "OpenRLHF/Llama-3-8b-sft-mixture"


def test_each_rank_fetches_only_the_files_it_reads():
    from rlhf_core.rank.loading import files_for_rank

    paths = ["actor_model/ds/mp_rank_00_model_states.pt", "actor_model/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "actor_model/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt",
             "actor_model/ds/bf16_zero_pp_rank_10_mp_rank_00_optim_states.pt", "actor_model/hf/model.safetensors",
             "actor_model/zero_to_fp32.py", "training_metadata.json"]
    shared = ["actor_model/ds/mp_rank_00_model_states.pt", "actor_model/zero_to_fp32.py", "training_metadata.json"]
    assert sorted(files_for_rank(paths, 1, all_shards=False)) == sorted(shared + [paths[2]])
    assert sorted(files_for_rank(paths, 10, all_shards=False)) == sorted(shared + [paths[3]])
    assert sorted(files_for_rank(paths, 0, all_shards=True)) == sorted(set(paths) - {paths[4]})
    # a checkpoint saved with --disable_ds_ckpt has only the Hugging Face weights to load
    weights_only = ["actor_model/hf/model.safetensors", "trainer_state.json"]
    assert files_for_rank(weights_only, 1, all_shards=False) == weights_only


def test_drift_compares_only_settings_both_versions_know(toy_assets):
    from rlhf_core.driver.resume import config_drift
    from rlhf_core.storage.metadata import CheckpointMetadata

    run = toy_run(toy_assets)
    saved = {"config": semantic_fields(run.sft), "seed": run.seed}
    assert config_drift(run, "sft", CheckpointMetadata.from_json(saved)) == []
    older = dict(saved["config"], zero_stage=2)  # semantic in an older version, operational now
    del older["learning_rate"]  # a setting the writing version did not have
    assert config_drift(run, "sft", CheckpointMetadata.from_json({**saved, "config": older})) == []
    changed = dict(saved["config"], max_len=128)
    changed_metadata = CheckpointMetadata.from_json({**saved, "config": changed})
    assert config_drift(run, "sft", changed_metadata) == ["max_len: 128 -> 64"]


def test_the_chunk_boundary_rule_is_stated_once_and_read_by_the_plan_and_the_ranks():
    import re
    from pathlib import Path

    from rlhf_core.driver.plan import chunk_ends

    assert chunk_ends(10, 4) == [4, 8, 10] and chunk_ends(8, 4) == [4, 8]
    assert chunk_ends(10, -1) == [10] and chunk_ends(10, 0) == [10]
    root = Path(__file__).resolve().parents[2] / "rlhf_core"
    restated = [f"{path.relative_to(root)}:{number}" for path in root.rglob("*.py")
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"% *(self\.)?cfg\.save_steps *== *0|range\(chunk, total_steps", line)]
    assert restated == []


def test_the_ranks_evaluate_at_the_chunk_ends_the_plan_hands_them():
    """The ranks do not derive the chunk ends again from save_steps: they take the plan's (`StagePlan.targets`),
    so a plan whose ends differ from the rule (here 3 and 7 with save_steps 5) is what they follow."""
    from types import SimpleNamespace

    from rlhf_core.rank.trainers.base import DeepSpeedTrainer
    from rlhf_core.stages.sft import SFTConfig

    class Probe(DeepSpeedTrainer):
        stage, config_class = "sft", SFTConfig
        train_step = None

    cfg = SimpleNamespace(param_dtype="fp32", save_steps=5, eval_steps=-1)
    trainer = Probe(SimpleNamespace(section=lambda stage, kind: cfg), [3, 7], rank=0, world_size=1)
    assert trainer.total_steps == 7
    assert [step for step in range(1, 8) if trainer.is_chunk_end(step)] == [3, 7]
