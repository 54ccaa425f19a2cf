"""2-rank PPO with the adaptive KL controller (`--kl_target`), SIGKILLed mid-chunk and resumed, ends bit-exact
with the uninterrupted 2-rank run.

This holds only if both ranks hold the same KL coefficient: a checkpoint keeps rank 0's controller state, and
every rank restores it. With the rank-local KL the controller was fed before, rank 1's coefficient drifted
from rank 0's, so the resumed rank 1 shaped its rewards with another coefficient than the uninterrupted one.
REINFORCE++ (`reinforce`) whitens its returns, so the all-reduced whitening statistics are on this path too.
Each run is one process (tests/integration/fault_driver.py) joining the worker's Ray head; a fault hook kills
it (driver and ranks) on its way into step 4, after step 3 is committed.

The toy policy earns no reward at first, so the KL stays 0 for two steps and the ranks' coefficients could only
part from step 3 on: hence a checkpoint at step 3. `kl_target` sits near the KL observed then, so the
controller's error is not clipped at +-0.2 (a clipped error moves every rank's coefficient alike, and the
rank-local controller would pass unnoticed). Measured with rank-local KLs: 0.0195 and 0.0284, global 0.0242.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.driver.plan import resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.stages.ppo import PPOConfig
from tests.integration.conftest import kill_fault_driver_once_committed

pytestmark = pytest.mark.slow

PROJECT_DIR = Path(__file__).resolve().parents[2]
INIT_KL_COEF = 0.05


def two_rank_ppo(toy: dict[str, str], root: Path) -> RunConfig:
    """4 PPO steps in chunks of 3 and 1 on 2 ranks: 4 prompts x 2 samples per step, one optimizer step each."""
    ppo = PPOConfig(pretrain=toy["model"], reward_fn="rlhf_core.toy:gold_reward", prompt_data=toy["prompts"],
                    input_key="prompt", advantage_estimator="reinforce", max_samples=16, n_samples_per_prompt=2,
                    rollout_batch_size=4, micro_rollout_batch_size=4, train_batch_size=8, micro_train_batch_size=4,
                    max_new_tokens=8, learning_rate=1e-3, init_kl_coef=INIT_KL_COEF, kl_target=0.025,
                    kl_horizon=100, save_steps=3, save_path=str(root / "out"))
    return resolve_paths(RunConfig(stages=["ppo"], ckpt_path=str(root / "ckpt"), load_checkpoint=True,
                                   max_ckpt_num=0, num_workers=2, seed=7, ppo=ppo))


def job(run: RunConfig, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                          env=env, capture_output=True, text=True, timeout=900, cwd=PROJECT_DIR, check=False)


def step_metadata(run: RunConfig, step: int) -> dict:
    return json.loads((Path(run.stage_url("ppo")) / f"step_{step}" / "training_metadata.json").read_text())


@pytest.fixture(scope="module")
def reference(toy_assets, rlhf_env, tmp_path_factory) -> RunConfig:
    """The uninterrupted 2-rank run, with no snapshots between commits."""
    run = two_rank_ppo(toy_assets, tmp_path_factory.mktemp("reference")).model_copy(update={"snapshot_steps": -1})
    uninterrupted = job(run, rlhf_env)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert step_metadata(run, 4)["world_size"] == 2
    return run


def assert_same_weights_and_kl(run: RunConfig, reference: RunConfig) -> None:
    expected = load_file(str(Path(reference.ppo.save_path) / "model.safetensors"))
    actual = load_file(str(Path(run.ppo.save_path) / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted 2-rank run"
    for step in (3, 4):
        kl_coef = step_metadata(run, step)["metrics"]["kl_coef"]
        assert kl_coef == step_metadata(reference, step)["metrics"]["kl_coef"], step
        assert kl_coef != INIT_KL_COEF  # the controller really moved


def test_two_rank_ppo_with_kl_target_killed_and_resumed_matches_the_uninterrupted_run(toy_assets, rlhf_env,
                                                                                      tmp_path, reference):
    run = two_rank_ppo(toy_assets, tmp_path / "killed")
    stage_dir = Path(run.stage_url("ppo"))
    kill_fault_driver_once_committed(run.model_dump_json(), rlhf_env, 4, tmp_path / "faults", stage_dir / "step_3")
    assert not (stage_dir / "step_4").exists()
    resumed = job(run, rlhf_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights_and_kl(run, reference)


def test_a_ppo_rank_lost_mid_chunk_is_replaced_from_a_snapshot_between_commits_and_stays_exact(
        toy_assets, rlhf_env, tmp_path, reference):
    """Issue 47: a rank SIGKILLed as it enters step 3 (the first chunk's last) is replaced in place from the
    snapshot every rank took after step 2 (`snapshot_steps` 1), not from the start: PPO's policy, critic-free
    REINFORCE++ state, optimizer and KL controller come back from it, and the run ends bit-exact (weights and KL
    coefficients) with the uninterrupted run that took no snapshots."""
    run = two_rank_ppo(toy_assets, tmp_path / "replaced").model_copy(update={"snapshot_steps": 1})
    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@3=kill", "RLHF_FAULT_STATE": str(faults),
           "RLHF_FAULT_JOB_PID": "0"}  # the rank alone dies, not the job
    replaced = job(run, env)
    log = replaced.stdout + replaced.stderr
    assert replaced.returncode == 0, log[-3000:]
    assert (faults / "train_step@3").exists(), "the fault never fired"
    lines = [line for line in log.splitlines() if "was lost mid-chunk" in line]
    assert len(lines) == 1 and "training again from step 2 (a snapshot between commits" in lines[0], log[-3000:]
    assert_same_weights_and_kl(run, reference)
