"""ZeRO-3 kill tests: `rlhf train sft --zero_stage 3` on 2 ranks, a rank SIGKILLed as it enters step 8 (replaced
in place from a snapshot between commits), then the whole command SIGKILLed mid-chunk, then finished by a
rerun on 2 ranks (bit-exact against an uninterrupted 2-rank run that took no snapshots) and on 1 rank (through
DeepSpeed's universal format; equal within float rounding, since the reduction order changes with the world size).

The toy model's matrices are partitioned across the ranks (ZeRO-3 keeps only tensors smaller than
10 x hidden_size whole), so the hf/ export really gathers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import RLHF, run_rlhf
from tests.integration.conftest import AFTER_THE_STEP_5_COMMIT, NO_SNAPSHOTS, PAUSED_ON_PURPOSE, train_sft_args
from tests.integration.test_kill_resume import kill_in_the_third_chunk

pytestmark = pytest.mark.slow


def zero3_args(toy: dict, ckpt: Path, out: Path, num_workers: int) -> list[str]:
    return train_sft_args(toy, ckpt, out) + ["--zero_stage", "3", "--num_workers", str(num_workers)]


@pytest.fixture(scope="module")
def reference_zero3_weights(toy_assets, rlhf_env, tmp_path_factory) -> dict:
    """The final weights of the 2-rank ZeRO-3 run, never interrupted."""
    out = tmp_path_factory.mktemp("reference-zero3")
    reference = run_rlhf(zero3_args(toy_assets, out / "ckpt", out / "model", 2) + NO_SNAPSHOTS, rlhf_env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def killed_zero3_ckpt(toy_assets, rlhf_env, tmp_path_factory) -> Path:
    """The checkpoint folder of a 2-rank ZeRO-3 run that lost a rank as it entered step 8 (replaced in place from
    a snapshot between commits) and was SIGKILLed inside step 13 (steps 5 and 10 committed)."""
    root = tmp_path_factory.mktemp("killed-zero3")
    ckpt, faults, log = root / "ckpt", root / "faults", root / "command.log"
    faults.mkdir()
    paused_env = {**rlhf_env,
                  "RLHF_FAULT_INJECT": f"{AFTER_THE_STEP_5_COMMIT},train_step@8=kill,train_step@13=sleep:600",
                  "RLHF_FAULT_STATE": str(faults)}
    command = [RLHF, *zero3_args(toy_assets, ckpt, root / "out", 2), *PAUSED_ON_PURPOSE, "--snapshot_steps", "1"]
    with open(log, "wb") as output:
        kill_in_the_third_chunk(command, paused_env, ckpt, output)
    assert sorted(p.name for p in (ckpt / "rlhf" / "sft").glob("step_*")) == ["step_10", "step_5"]
    replaced = [line for line in log.read_text().splitlines() if "Replaced the ranks in" in line]
    assert len(replaced) == 1 and "training again from step 7 (a snapshot between commits" in replaced[0], \
        log.read_text()[-3000:]
    return ckpt


def rerun(toy_assets, rlhf_env, killed_ckpt: Path, tmp_path: Path, num_workers: int) -> dict:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(killed_ckpt, ckpt)
    resumed = run_rlhf(zero3_args(toy_assets, ckpt, out, num_workers), rlhf_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "step 10/32: cached" in log and "step 15/32: trained 5 steps" in log, log[-3000:]
    return load_file(str(out / "model.safetensors"))


def test_zero3_sigkill_mid_chunk_then_rerun_matches_uninterrupted_run(toy_assets, rlhf_env, tmp_path,
                                                                      killed_zero3_ckpt, reference_zero3_weights):
    """Its 90-135 s are mostly the module's fixtures it is the first to need: an uninterrupted ZeRO-3 run and a
    killed one (two jobs, each with its own start-up), then the rerun on 2 ranks."""
    actual = rerun(toy_assets, rlhf_env, killed_zero3_ckpt, tmp_path, num_workers=2)
    assert actual.keys() == reference_zero3_weights.keys()
    for name, tensor in reference_zero3_weights.items():
        assert actual[name].dtype == tensor.dtype and actual[name].equal(tensor), f"{name} differs"


def test_zero3_checkpoint_of_two_ranks_finishes_on_one(toy_assets, rlhf_env, tmp_path, killed_zero3_ckpt,
                                                       reference_zero3_weights):
    actual = rerun(toy_assets, rlhf_env, killed_zero3_ckpt, tmp_path, num_workers=1)
    assert actual.keys() == reference_zero3_weights.keys()
    for name, tensor in reference_zero3_weights.items():
        difference = (actual[name] - tensor).abs().max().item()
        assert difference <= 1e-3, f"{name}: max |diff| {difference}"
