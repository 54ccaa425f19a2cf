"""DPO as a user runs it, with the guarantees of the other stages: it learns the toy's preferences, a SIGKILLed
2-rank run resumes bit-exact on 2 ranks and within float rounding on 1 (DeepSpeed's universal checkpoint), a
resume with another beta is refused in one sentence, and LoRA with packed samples exports an adapter.

The jobs run through tests/integration/fault_driver.py (one process joining the worker's Ray head, no Prefect);
the drift refusal runs `rlhf train dpo`, the CLI a user types. They share one uninterrupted 2-rank run and one
killed one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.config import RunConfig
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.stages.dpo import DPOConfig
from tests.conftest import run_rlhf
from tests.integration.conftest import (fault_driver_job, finished_copy,
                                        kill_fault_driver_once_committed)

pytestmark = pytest.mark.slow

KILLED_AT = 19  # paused inside step 19, after step 16 committed (chunks end at 16, 32, 48)


def dpo_run(toy: dict[str, str], root: Path, num_workers: int = 2, **settings) -> RunConfig:
    """48 DPO steps on 192 of the toy's 256 preference pairs (64 held out, as asked), in chunks of 16, each evaluated,
    from the toy model."""
    dpo = DPOConfig(**{"pretrain": toy["model"], "dataset": toy["prefs"], "prompt_key": "prompt",
                       "eval_holdout": 0.25, "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4,
                       "max_epochs": 2, "learning_rate": 5e-4, "beta": 0.1, "save_steps": 16, "eval_steps": 16,
                       "save_path": str(root / "out"), **settings})
    return resolve_paths(RunConfig(stages=["dpo"], ckpt_path=str(root / "ckpt"), load_checkpoint=True,
                                   max_ckpt_num=0, num_workers=num_workers, seed=11, dpo=dpo))



def checkpoint_metrics(run: RunConfig, step: int) -> dict:
    return json.loads((Path(run.stage_url("dpo")) / f"step_{step}" / "training_metadata.json").read_text())["metrics"]


def exported(run: RunConfig) -> dict:
    return load_file(str(Path(run.dpo.save_path) / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(toy_assets, rlhf_env, tmp_path_factory) -> RunConfig:
    """The uninterrupted 2-rank run."""
    run = dpo_run(toy_assets, tmp_path_factory.mktemp("dpo-reference"))
    done = fault_driver_job(run, rlhf_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def killed(toy_assets, rlhf_env, tmp_path_factory) -> RunConfig:
    """The same run, SIGKILLed inside step 19 with step 16 committed; each test resumes a copy of its folder."""
    root = tmp_path_factory.mktemp("dpo-killed")
    run = dpo_run(toy_assets, root)
    kill_fault_driver_once_committed(run.model_dump_json(), rlhf_env, KILLED_AT, root / "faults",
                                     Path(run.stage_url("dpo")) / "step_16")
    assert sorted(path.name for path in Path(run.stage_url("dpo")).glob("step_*")) == ["step_16"]
    return run



def test_dpo_learns_the_toys_preferences(reference):
    """At the start the policy is its reference: every implicit reward is 0 and the loss is log 2. By the end the
    held-out loss has fallen and most held-out chosen replies out-score their rejected ones."""
    first, last = checkpoint_metrics(reference, 16), checkpoint_metrics(reference, 48)
    print(f"eval at step 16: {first}\neval at step 48: {last}")
    assert last["eval_loss"] < first["eval_loss"] < math.log(2)
    assert last["eval_accuracy"] >= 0.75 and last["eval_accuracy"] >= first["eval_accuracy"]
    assert last["chosen_reward"] > last["rejected_reward"]


def test_a_killed_dpo_run_resumes_bit_exactly(killed, reference, rlhf_env, tmp_path):
    expected, actual = exported(reference), exported(finished_copy(killed, tmp_path, 2, rlhf_env))
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"


def test_a_two_rank_dpo_checkpoint_finishes_on_one_rank(killed, reference, rlhf_env, tmp_path):
    """The 2-rank step-16 checkpoint finished by 1 rank through the universal format: equal within float rounding
    (the reduction order changes with the world size)."""
    one_rank = finished_copy(killed, tmp_path, 1, rlhf_env)
    expected, actual = exported(reference), exported(one_rank)
    for name, tensor in expected.items():
        difference = (actual[name] - tensor).abs().max().item()
        assert difference <= 1e-3, f"{name}: max |diff| {difference}"
    assert checkpoint_metrics(one_rank, 48)["eval_accuracy"] >= 0.75


def test_resuming_with_another_beta_is_refused_in_one_sentence(reference, toy_assets, rlhf_env):
    cfg = reference.dpo
    refused = run_rlhf(["train", "dpo", "--pretrain", cfg.pretrain, "--dataset", cfg.dataset, "--prompt_key", "prompt",
                        "--eval_holdout", "0.25", "--max_len", "64", "--train_batch_size", "8",
                        "--micro_train_batch_size", "4", "--max_epochs", "2", "--learning_rate", "5e-4",
                        "--save_steps", "16", "--eval_steps", "16", "--save_path", cfg.save_path, "--ckpt_path", reference.ckpt_path,
                        "--num_workers", "2", "--seed", "11", "--load_checkpoint", "--beta", "0.2"], rlhf_env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(lines) == 1 and "beta: 0.1 -> 0.2" in lines[0] and "--allow_config_change" in lines[0], \
        refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


def test_lora_with_packed_samples_exports_an_adapter(toy_assets, rlhf_env, tmp_path):
    run = dpo_run(toy_assets, tmp_path, num_workers=1, lora_rank=8, lora_alpha=16, packing_samples=True,
                  max_samples=64, max_epochs=1, save_steps=-1, eval_steps=-1)  # evaluated at the epoch's end
    done = fault_driver_job(run, rlhf_env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path(run.dpo.save_path)
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert checkpoint_metrics(run, 6)["eval_loss"] < math.log(2)
