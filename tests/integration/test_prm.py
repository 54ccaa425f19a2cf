"""The process reward model on a toy in Math-Shepherd's shape, with the guarantees of the other stages: each step
of a sort answer ends in a placeholder and is labelled by whether its digit is right; the training loss falls,
a SIGKILLed 2-rank run resumes bit-exact on 2 ranks and within float rounding on 1 (DeepSpeed's universal
checkpoint), and a resume with another learning rate is refused in one sentence.
(The 2-layer toy model does not beat the majority label on held-out steps in 48 steps: eval accuracy 0.587 at
steps 16 and 48 against a 0.592 majority share; this module claims fitting, not generalisation.)

The jobs run through tests/integration/fault_driver.py (one process joining the worker's Ray head, no Prefect);
the drift refusal runs `rlhf train prm`, the CLI a user types. They share one uninterrupted 2-rank run and one
killed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.config import RunConfig
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.stages.prm import PRMConfig
from rlhf_core.toy import STEP_BAD, STEP_GOOD, STEP_PLACEHOLDER, step_labelled_rows
from tests.conftest import run_rlhf
from tests.integration.conftest import (fault_driver_job, finished_copy,
                                        kill_fault_driver_once_committed)

pytestmark = pytest.mark.slow

KILLED_AT = 19  # paused inside step 19, after step 16 committed (chunks end at 16, 32, 48)



def prm_run(toy: dict[str, str], data: dict[str, str], root: Path, num_workers: int = 2) -> RunConfig:
    """48 PRM steps (256 rows, 3 epochs, 16 rows a step) from the toy model, in chunks of 16, evaluated on 64
    held-out rows."""
    prm = PRMConfig(pretrain=toy["model"], dataset=data["train"], eval_dataset=data["eval"], input_key="input",
                    label_key="value", placeholder_token=STEP_PLACEHOLDER, reward_tokens=[STEP_GOOD, STEP_BAD],
                    max_len=32,
                    train_batch_size=16, micro_train_batch_size=8, max_epochs=3, learning_rate=2e-3, save_steps=16,
                    save_path=str(root / "out"))
    return resolve_paths(RunConfig(stages=["prm"], ckpt_path=str(root / "ckpt"), load_checkpoint=True,
                                   max_ckpt_num=0, num_workers=num_workers, seed=5, prm=prm))



def checkpoint_metrics(run: RunConfig, step: int) -> dict:
    return json.loads((Path(run.stage_url("prm")) / f"step_{step}" / "training_metadata.json").read_text())["metrics"]


def exported(run: RunConfig) -> dict:
    return load_file(str(Path(run.prm.save_path) / "model.safetensors"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("prm-data")
    paths = {}
    for split, (num_rows, seed) in {"train": (256, 0), "eval": (64, 1)}.items():
        paths[split] = str(folder / f"{split}.jsonl")
        Path(paths[split]).write_text("".join(json.dumps(row) + "\n" for row in step_labelled_rows(num_rows, seed)))
    return paths


@pytest.fixture(scope="module")
def reference(toy_assets, data, rlhf_env, tmp_path_factory) -> RunConfig:
    """The uninterrupted 2-rank run."""
    run = prm_run(toy_assets, data, tmp_path_factory.mktemp("prm-reference"))
    done = fault_driver_job(run, rlhf_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def killed(toy_assets, data, rlhf_env, tmp_path_factory) -> RunConfig:
    """The same run, SIGKILLed inside step 19 with step 16 committed; each test resumes a copy of its folder."""
    root = tmp_path_factory.mktemp("prm-killed")
    run = prm_run(toy_assets, data, root)
    kill_fault_driver_once_committed(run.model_dump_json(), rlhf_env, KILLED_AT, root / "faults",
                                     Path(run.stage_url("prm")) / "step_16")
    assert sorted(path.name for path in Path(run.stage_url("prm")).glob("step_*")) == ["step_16"]
    return run



def test_the_prm_fits_the_training_steps(reference, data):
    """The chunk's mean training loss falls from 0.692 (steps 1-16) to 0.675 (steps 33-48) and the last step's
    training accuracy rises from 0.647 (step 16) to 0.685 (step 48); both checkpoints are evaluated on the
    held-out steps (eval loss 0.683 -> 0.681)."""
    first, last = checkpoint_metrics(reference, 16), checkpoint_metrics(reference, 48)
    labels = [label for line in Path(data["eval"]).read_text().splitlines() for label in json.loads(line)["value"]]
    majority = max(labels.count(STEP_GOOD), labels.count(STEP_BAD)) / len(labels)
    print(f"metrics at step 16: {first}\nmetrics at step 48: {last}\nheld-out majority share: {majority:.3f}")
    assert last["mean_loss"] < first["mean_loss"] and last["accuracy"] > first["accuracy"]
    assert 0 < last["eval_accuracy"] < 1 and last["eval_loss"] > 0  # evaluated on the eval steps


def test_a_killed_prm_run_resumes_bit_exactly(killed, reference, rlhf_env, tmp_path):
    expected, actual = exported(reference), exported(finished_copy(killed, tmp_path, 2, rlhf_env))
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"


def test_a_two_rank_prm_checkpoint_finishes_on_one_rank(killed, reference, rlhf_env, tmp_path):
    """The 2-rank step-16 checkpoint finished by 1 rank through the universal format: equal within float rounding
    (the reduction order changes with the world size)."""
    one_rank = finished_copy(killed, tmp_path, 1, rlhf_env)
    expected, actual = exported(reference), exported(one_rank)
    assert expected.keys() == actual.keys()
    differences = {name: (actual[name] - tensor).abs().max().item() for name, tensor in expected.items()}
    print(f"largest |diff| from the 2-rank run: {max(differences.values())}")
    for name, difference in differences.items():
        assert difference <= 1e-3, f"{name}: max |diff| {difference}"
    assert abs(checkpoint_metrics(one_rank, 48)["eval_loss"] - checkpoint_metrics(reference, 48)["eval_loss"]) <= 1e-3


def test_resuming_with_another_learning_rate_is_refused_in_one_sentence(reference, rlhf_env):
    cfg = reference.prm
    refused = run_rlhf(["train", "prm", "--pretrain", cfg.pretrain, "--dataset", cfg.dataset,
                        "--eval_dataset", cfg.eval_dataset, "--input_key", "input", "--label_key", "value",
                        "--placeholder_token", STEP_PLACEHOLDER, "--reward_tokens", STEP_GOOD, STEP_BAD,
                        "--max_len", "32",
                        "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_epochs", "3",
                        "--save_steps", "16", "--save_path", cfg.save_path, "--ckpt_path", reference.ckpt_path,
                        "--max_ckpt_num", "0", "--num_workers", "2", "--seed", "5", "--load_checkpoint",
                        "--learning_rate", "1e-3"], rlhf_env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(lines) == 1 and "learning_rate: 0.002 -> 0.001" in lines[0] and "--allow_config_change" in lines[0], \
        refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
