"""The process reward model on a toy in Math-Shepherd's shape: each step of a sort answer ends in a placeholder
and is labelled by whether its digit is right. Its training loss falls, and a SIGKILLed run resumes bit-exactly.
(The 2-layer toy model does not beat the majority label on held-out steps in 48 steps: eval accuracy 0.587
against a 0.592 majority share; this test claims fitting, not generalisation.) Jobs run through tests/integration/fault_driver.py (one process, its own local Ray)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.config import RunConfig
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.stages.prm import PRMConfig
from tests.integration.conftest import kill_fault_driver_once_committed

pytestmark = pytest.mark.slow

PROJECT_DIR = Path(__file__).resolve().parents[2]
PLACEHOLDER, GOOD, BAD = "user", "1", "0"  # tokens of the toy vocabulary (Math-Shepherd: ки, +, -)


def step_labelled_rows(num_rows: int, seed: int) -> list[dict]:
    """`sort : 3 1 2 = 1 user 5 user 3 user` with labels 1 0 1: each step is labelled by whether its digit is the
    sorted list's digit there; 40% of the steps have a random digit instead."""
    rng, rows = random.Random(seed), []
    for _ in range(num_rows):
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 5))]
        right = sorted(digits)
        answer = [(d + rng.randint(1, 9)) % 10 if rng.random() < 0.4 else d for d in right]
        labels = [GOOD if given == expected else BAD for given, expected in zip(answer, right)]
        text = f"sort : {' '.join(map(str, digits))} = " + " ".join(f"{d} {PLACEHOLDER}" for d in answer)
        rows.append({"input": text, "value": labels})
    return rows


def prm_run(toy: dict[str, str], data: dict[str, str], root: Path) -> RunConfig:
    prm = PRMConfig(pretrain=toy["model"], dataset=data["train"], eval_dataset=data["eval"], input_key="input",
                    label_key="value", placeholder_token=PLACEHOLDER, reward_tokens=[GOOD, BAD], max_len=32,
                    train_batch_size=16, micro_train_batch_size=8, max_epochs=3, learning_rate=2e-3, save_steps=8,
                    save_path=str(root / "out"))
    return resolve_paths(RunConfig(stages=["prm"], ckpt_path=str(root / "ckpt"), load_checkpoint=True,
                                   max_ckpt_num=0, seed=5, prm=prm))


def job(run: RunConfig, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                          env=env, capture_output=True, text=True, timeout=900, cwd=PROJECT_DIR, check=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("prm-data")
    paths = {}
    for split, (num_rows, seed) in {"train": (256, 0), "eval": (64, 1)}.items():
        paths[split] = str(folder / f"{split}.jsonl")
        Path(paths[split]).write_text("".join(json.dumps(row) + "\n" for row in step_labelled_rows(num_rows, seed)))
    return paths


def test_the_prm_fits_the_steps_and_a_killed_run_resumes_bit_exactly(toy_assets, data, rlhf_env, tmp_path):
    reference = prm_run(toy_assets, data, tmp_path / "reference")
    done = job(reference, rlhf_env)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads((Path(reference.stage_url("prm")) / f"step_{step}" / "training_metadata.json")
                          .read_text())["metrics"] for step in (8, 48)]
    print(f"metrics at steps 8 and 48: {metrics}")
    assert metrics[1]["mean_loss"] < metrics[0]["mean_loss"] and metrics[1]["accuracy"] > metrics[0]["accuracy"]
    assert 0 < metrics[1]["eval_accuracy"] < 1 and metrics[1]["eval_loss"] > 0  # evaluated on the eval steps

    killed = prm_run(toy_assets, data, tmp_path / "killed")
    kill_fault_driver_once_committed(killed.model_dump_json(), rlhf_env, 11, tmp_path / "faults",
                                     Path(killed.stage_url("prm")) / "step_8")
    resumed = job(killed, rlhf_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = load_file(str(Path(reference.prm.save_path) / "model.safetensors"))
    actual = load_file(str(Path(killed.prm.save_path) / "model.safetensors"))
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"
