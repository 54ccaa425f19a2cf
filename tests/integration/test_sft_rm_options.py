"""OpenRLHF's training options on a real local Ray with real DeepSpeed, driven through rlhf_core (no Prefect):
bf16 autocast resumes exactly, --disable_ds_ckpt resumes from weights only, SFT eval_loss with packing,
the reward model's packing / margin / eval / mean-std, and a rank's UserError reaching the driver intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.config import RunConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.models.precision import cpu_supports_bf16
from rlhf_core.storage.manifest import DEEPSPEED_STATE_DIR, TRAINER_STATE_NAME
from rlhf_core.errors import UserError
from rlhf_core.driver.resume import begin_stage
from tests.integration.chunks import train_chunks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield
    import ray

    ray.shutdown()


def sft_run(toy, ckpt: Path, **sft_overrides) -> RunConfig:
    sft = {"pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
           "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 1, "learning_rate": 1e-3,
           "save_steps": 5, **sft_overrides}
    return RunConfig(sft=SFTConfig(**sft), ckpt_path=str(ckpt), max_ckpt_num=0, load_checkpoint=True)


def train(run: RunConfig, stage: str, *targets: int, cold: bool = True) -> list:
    """ensure_checkpoint for each target; `cold` restarts the workers between chunks (a resume)."""
    return train_chunks(run, stage, *targets, lineage=begin_stage(run, stage), cold=cold)


def step_dir(run: RunConfig, stage: str, step: int) -> Path:
    return Path(run.stage_url(stage)) / f"step_{step}"


def hf_weights(run: RunConfig, step: int) -> dict:
    return load_file(str(step_dir(run, "sft", step) / "actor_model" / "hf" / "model.safetensors"))


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16: param_dtype bf16 trains fp32")
def test_bf16_autocast_packed_run_resumed_equals_one_uninterrupted_chunk(toy_assets, tmp_path):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(Path(toy_assets["sft"]).read_text().splitlines(keepends=True)[:24]))
    settings = {"param_dtype": "bf16", "packing_samples": True, "eval_dataset": str(eval_data), "eval_steps": 5,
                "lr_scheduler": "cosine", "adam_betas": (0.8, 0.99)}
    chunked = sft_run(toy_assets, tmp_path / "chunked", **settings)
    first, second = train(chunked, "sft", 5, 10)
    whole = sft_run(toy_assets, tmp_path / "whole", **settings)
    (uninterrupted,) = train(whole, "sft", 10)
    assert second.num_steps_trained == 5 and uninterrupted.num_steps_trained == 10
    assert {"eval_loss", "loss", "lr"} <= second.metrics.keys()
    for name in ("eval_loss", "loss", "lr"):  # (mean_loss is the chunk's mean: it differs by design)
        assert second.metrics[name] == uninterrupted.metrics[name], name
    expected = hf_weights(whole, 10)
    for name, tensor in hf_weights(chunked, 10).items():
        assert tensor.dtype == expected[name].dtype and tensor.equal(expected[name]), name
    fp32 = sft_run(toy_assets, tmp_path / "fp32", **{**settings, "param_dtype": "fp32"})
    (fp32_result,) = train(fp32, "sft", 5)
    assert fp32_result.metrics["loss"] != first.metrics["loss"]  # autocast really ran in bf16


def test_disable_ds_ckpt_keeps_weights_only_and_resumes_with_a_fresh_optimizer(toy_assets, tmp_path):
    run = sft_run(toy_assets, tmp_path / "light", disable_ds_ckpt=True)
    train(run, "sft", 5)
    step_5 = step_dir(run, "sft", 5)
    assert not (step_5 / "actor_model" / DEEPSPEED_STATE_DIR).exists()
    assert json.loads((step_5 / TRAINER_STATE_NAME).read_text())["step"] == 5
    assert not [p for p in step_5.rglob("*.pt")]
    (resumed,) = train(run, "sft", 10)
    assert resumed.num_steps_trained == 5  # (its warning comes from the rank through Ray's log, asynchronously)
    full = sft_run(toy_assets, tmp_path / "full")
    (reference,) = train(full, "sft", 10)
    assert resumed.metrics["lr"] == pytest.approx(reference.metrics["lr"])  # the schedule continued
    assert any(not tensor.equal(hf_weights(full, 10)[name]) for name, tensor in hf_weights(run, 10).items())


def write_prefs_with_margins(source: str, target: Path) -> str:
    lines = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    target.write_text("".join(json.dumps({**row, "margin": (i % 3) * 0.5}) + "\n" for i, row in enumerate(lines)))
    return str(target)


def test_reward_model_packed_with_margins_reports_eval_and_records_reward_stats(toy_assets, tmp_path):
    prefs = write_prefs_with_margins(toy_assets["prefs"], tmp_path / "prefs.jsonl")
    rm = RMConfig(pretrain=toy_assets["model"], dataset=prefs, prompt_key="prompt", eval_dataset=prefs, max_samples=48, max_len=64,
                  train_batch_size=8, micro_train_batch_size=4, learning_rate=1e-3, save_steps=3, eval_steps=3,
                  packing_samples=True, margin_loss=True)
    run = RunConfig(rm=rm, stages=["rm"], ckpt_path=str(tmp_path / "ckpt"), max_ckpt_num=0, load_checkpoint=True)
    (result,) = train(run, "rm", 3)
    assert {"eval_accuracy", "eval_loss", "reward_mean", "reward_std", "accuracy"} <= result.metrics.keys()
    assert 0.0 <= result.metrics["eval_accuracy"] <= 1.0
    config = json.loads((step_dir(run, "rm", 3) / "reward_model" / "hf" / "config.json").read_text())
    assert config["mean"] == pytest.approx(result.metrics["reward_mean"])
    assert config["std"] == pytest.approx(result.metrics["reward_std"]) and config["std"] > 0


def test_a_user_error_inside_a_rank_reaches_the_driver_as_itself(toy_assets, tmp_path):
    run = sft_run(toy_assets, tmp_path, param_dtype="fp16")  # refused on a CPU rank, not by the driver
    with pytest.raises(UserError) as raised:
        train(run, "sft", 5)
    assert type(raised.value) is UserError
    assert str(raised.value).startswith("--param_dtype fp16 needs a GPU") and "Traceback" not in str(raised.value)
    assert not os.path.exists(step_dir(run, "sft", 5))
