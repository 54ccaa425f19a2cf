"""Config: validators, semantic hash, YAML loading and CLI flag errors (exit code 2, one sentence)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.cli import main
from rlhf_core.config import RunConfig, semantic_hash
from rlhf_core.config_file import load_run_config
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.errors import UserError


def sft(**overrides) -> SFTConfig:
    return SFTConfig(**{"pretrain": "m", "dataset": "d.jsonl", "train_batch_size": 8,
                        "micro_train_batch_size": 4, **overrides})


def test_batch_sizes_must_divide_across_workers():
    RunConfig(num_workers=2, sft=sft())
    with pytest.raises(ValidationError, match="micro_train_batch_size x num_workers"):
        RunConfig(num_workers=4, sft=sft())


def test_unknown_and_unavailable_stages_are_refused():
    with pytest.raises(ValidationError, match="unknown stage 'kto'"):
        RunConfig(stages=["kto"], sft=sft())
    with pytest.raises(ValidationError, match="in pipeline order"):
        RunConfig(stages=["rm", "sft"], sft=sft())
    with pytest.raises(ValidationError, match="has no settings"):
        RunConfig(stages=["sft"])


def test_semantic_hash_ignores_operational_fields_only():
    base = RunConfig(sft=sft())
    same = RunConfig(sft=sft(logging_steps=7, save_path="/elsewhere"), ckpt_path="s3://b/c", max_ckpt_num=9,
                     num_workers=2)
    assert semantic_hash(base, "sft") == semantic_hash(same, "sft")
    assert semantic_hash(base, "sft") != semantic_hash(RunConfig(sft=sft(train_batch_size=16)), "sft")
    assert semantic_hash(base, "sft") != semantic_hash(RunConfig(sft=sft(), seed=1), "sft")


def test_num_workers_changes_the_math_of_ppo_only(tmp_path):
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.driver.resume import config_drift
    from rlhf_core.storage.metadata import CheckpointMetadata

    def ppo_run(num_workers: int, **overrides) -> RunConfig:
        ppo = PPOConfig(pretrain="m", reward_fn="rewards:length", prompt_data="p.jsonl", rollout_batch_size=4,
                        train_batch_size=4, micro_train_batch_size=1, micro_rollout_batch_size=1)
        return RunConfig(stages=["ppo"], ppo=ppo, num_workers=num_workers, **overrides)

    assert semantic_hash(ppo_run(1), "ppo") != semantic_hash(ppo_run(2), "ppo")
    saved = CheckpointMetadata.from_json({"config": {}, "seed": 42, "world_size": 2})
    changes = config_drift(ppo_run(1), "ppo", saved)
    assert "num_workers: 2 -> 1 (each PPO rank samples with its own seed)" in changes
    assert not any("num_workers" in change for change in config_drift(ppo_run(1, allow_fewer_workers=True), "ppo", saved))


def test_yaml_config_errors_name_file_and_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("stages: [sft]\nsft:\n  pretrain: m\n  dataset: d.jsonl\n  train_batch_size: 0\n")
    with pytest.raises(UserError, match=r"run.yaml line 5: sft.train_batch_size 0: input should be greater than or equal to 1"):
        load_run_config(str(path))
    path.write_text("stages: [sft\nsft: {}\n")
    with pytest.raises(UserError, match=r"run.yaml line \d+: not valid YAML"):
        load_run_config(str(path))
    path.write_text("stages: [sft]\nsft: {pretrain: m, dataset: d.jsonl}\nwarmup: 3\n")
    with pytest.raises(UserError, match="warmup is not a known setting"):
        load_run_config(str(path))


def test_yaml_config_loads(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_name: exp1\nstages: [sft]\nsft:\n  pretrain: m\n  dataset: d.jsonl\n  save_steps: 5\n")
    run = load_run_config(str(path))
    assert run.run_name == "exp1" and run.sft.save_steps == 5


# The flags whose defaults are not OpenRLHF's, given: a command refused after its config is built (by the
# preflight) then prints only its error, not the note that names such defaults left out.
OURS_GIVEN = ["--save_path", "./out/sft", "--zero_stage", "0", "--param_dtype", "fp32", "--attn_implementation", "sdpa"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dataset", "d.jsonl"], "--pretrain is required"),
        (["--pretrain", "m", "--dataset", "d.jsonl", "--save_steps", "0"], "--save_steps must be a positive"),
        (["--pretrain", "m", "--dataset", "d.jsonl", "--train_batch_size", "6", "--micro_train_batch_size", "4"],
         "must be a multiple of --micro_train_batch_size"),
        (["--pretrain", "/no/such/model", "--dataset", "d.jsonl", *OURS_GIVEN], "is not a model folder"),
        (["--pretrain", "m", "--dataset", "d.jsonl", "--storage_options", '{"secret": "s"}'],
         "--storage_options must not hold the secret 'secret'"),
        (["--pretrain", "m", "--dataset", "d.jsonl", "--resume_from", "5", *OURS_GIVEN], "--resume_from 5:"),
    ],
)
def test_bad_flags_exit_2_with_one_sentence(flags, expected, capsys, tmp_path):
    assert main(["train", "sft", "--ckpt_path", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_flags_keep_openrlhf_names():
    from flows.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["train"]._subparsers._group_actions[0] \
        .choices["sft"].format_help()
    for flag in ("--pretrain", "--save_steps", "--ckpt_path", "--load_checkpoint", "--max_ckpt_num",
                 "--save_hf_ckpt", "--zero_stage", "--lora_rank", "--target_modules", "--ray_address"):
        assert flag in help_text
    assert SFTConfig.model_fields["save_steps"].description.split(";")[0] in " ".join(help_text.split())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--num_workers", "1", "--vllm_num_engines", "2"], "--vllm_num_engines (2) must be 0 or --num_workers (1)"),
        (["--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2"], "vllm_tensor_parallel_size must be 1"),
    ],
)
def test_vllm_layouts_we_do_not_run_are_refused(flags, expected, capsys, tmp_path, toy_assets):
    ppo = ["train", "ppo", "--pretrain", toy_assets["model"], "--reward_pretrain", toy_assets["model"],
           "--prompt_data", toy_assets["prompts"], "--input_key", "prompt", "--ckpt_path", str(tmp_path),
           "--train_batch_size", "16", "--micro_train_batch_size", "4"]
    assert main([*ppo, *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_vllm_without_a_gpu_is_refused_before_training(capsys, tmp_path, toy_assets):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ppo = ["train", "ppo", "--pretrain", toy_assets["model"], "--reward_pretrain", toy_assets["model"],
           "--prompt_data", toy_assets["prompts"], "--input_key", "prompt", "--ckpt_path", str(tmp_path),
           "--train_batch_size", "16", "--micro_train_batch_size", "4",
           "--vllm_num_engines", "1"]
    assert main(ppo) == 2
    err = capsys.readouterr().err
    assert "--vllm_num_engines needs a GPU" in err, err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_typed_run_config_is_generated_from_the_stage_table():
    """rlhf_core/run_config.py, which editors and mypy read, declares exactly the registry's built-in stages."""
    from pathlib import Path

    from rlhf_core.config import render_run_config

    generated = Path(__file__).resolve().parents[2] / "rlhf_core" / "run_config.py"
    assert generated.read_text() == render_run_config(), \
        "regenerate: python -m rlhf_core.config > rlhf_core/run_config.py"


def test_the_stage_table_is_the_one_source_of_stages():
    from flows.cli import STAGE_CONFIGS
    from rlhf_core.stages import STAGES, TRAINING_STAGES
    from rlhf_core.stages.base import fields_with_role
    from rlhf_core.rank.trainers.base import DeepSpeedTrainer

    assert [name for name in RunConfig.model_fields if name in STAGES] == list(STAGES)
    for name, stage in STAGES.items():
        assert RunConfig.model_fields[name].annotation == stage.config | None
        assert stage.output_field in fields_with_role(stage.config, "output")
    assert tuple(STAGE_CONFIGS) == TRAINING_STAGES
    for name in TRAINING_STAGES:
        trainer = STAGES[name].trainer_class()
        assert issubclass(trainer, DeepSpeedTrainer) and trainer.stage == name
        assert trainer.config_class is STAGES[name].config  # the class its generic parameter names too (mypy)
        assert "pretrain" in fields_with_role(STAGES[name].config, "model")


def test_dpo_chains_from_sft_into_merge_and_export():
    """sft -> dpo -> merge -> export: DPO's policy and reference start from the SFT output (as OpenRLHF's
    --ref_pretrain defaults to --pretrain), the merge takes DPO's adapter onto that base, the export the merge."""
    run = RunConfig(stages=["sft", "dpo", "merge", "export"], sft=sft(save_path="/out/sft"),
                    dpo={"dataset": "prefs.jsonl", "lora_rank": 8, "save_path": "/out/dpo"},
                    merge={"output_path": "/out/merged"}, export={"save_path": "/out/final"})
    assert (run.dpo.pretrain, run.dpo.ref_pretrain) == ("/out/sft", "/out/sft")
    assert (run.merge.model_path, run.merge.lora_path) == ("/out/sft", "/out/dpo")
    assert run.export.model_path == "/out/merged"
    with pytest.raises(ValidationError, match="dpo needs its input: set it, or run sft before dpo"):
        RunConfig(stages=["dpo"], dpo={"dataset": "prefs.jsonl"})
