"""bf16 autocast on a CPU resumes exactly after a real crash: an SFT job with `--param_dtype bf16` is
SIGKILLed mid-stage (a fault hook inside training step 5, checkpoints every 2 steps), run again, and ends
with the same weights, tensor for tensor, as the same job never interrupted.

The jobs are `tests.integration.fault_driver` processes (rlhf_core on the worker's Ray head and DeepSpeed,
no Prefect), as in the fault matrix. Skipped where the CPU has no native bf16 (there bf16 trains fp32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.models.precision import cpu_supports_bf16

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16 (avx512_bf16/AMX)")]

KILL_POINT = "train_step@5"  # inside step 5: step 2 is committed (and 4, unless its commit was still running)


def bf16_sft_run(toy: dict[str, str], root: Path) -> RunConfig:
    """Six steps of bf16 SFT on the toy model, a checkpoint every two."""
    return RunConfig(
        ckpt_path=str(root / "ckpt"), load_checkpoint=True, max_ckpt_num=0, seed=42,
        sft=SFTConfig(pretrain=toy["model"], dataset=toy["sft"], input_key="prompt", output_key="response",
                      max_samples=48, max_len=64, train_batch_size=8, micro_train_batch_size=4, max_epochs=1,
                      learning_rate=1e-3, save_steps=2, param_dtype="bf16", save_path=str(root / "model")),
    )


def run_job(run: RunConfig, env: dict[str, str], log: Path) -> tuple[int, str]:
    """(exit status, log tail) of one job, run in a session of its own; whatever it leaves behind (a local
    Ray, where RAY_ADDRESS is unset) is killed with it. Output goes to a file: a pipe would wait for Ray's
    processes too."""
    with open(log, "w") as handle:
        job = subprocess.Popen([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                               env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                               start_new_session=True)
        try:
            job.wait(timeout=600)
        finally:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.wait()
    return job.returncode, log.read_text(errors="replace")[-4000:]


def committed_steps(run: RunConfig) -> list[int]:
    return [info.step for info in CheckpointStore(run.stage_url("sft")).list(verify=True) if info.is_committed]


def test_bf16_sft_killed_mid_stage_resumes_to_the_uninterrupted_weights(toy_assets, rlhf_env, tmp_path):
    reference = bf16_sft_run(toy_assets, tmp_path / "reference")
    status, log = run_job(reference, rlhf_env, tmp_path / "reference.log")
    assert status == 0, log

    killed = bf16_sft_run(toy_assets, tmp_path / "killed")
    fault_env = {**rlhf_env, "RLHF_FAULT_INJECT": f"{KILL_POINT}=kill", "RLHF_FAULT_STATE": str(tmp_path / "faults")}
    (tmp_path / "faults").mkdir()
    status, log = run_job(killed, fault_env, tmp_path / "killed.log")
    assert status == -9, f"the job did not die at {KILL_POINT} (rc {status}):\n{log}"
    # Step 4's commit may still be in flight behind step 5 (asynchronous checkpoints): then it is lost too.
    assert committed_steps(killed) in ([2], [2, 4])
    assert not Path(killed.sft.save_path).exists()

    status, log = run_job(killed, fault_env, tmp_path / "resumed.log")  # the fault fired once: this run completes
    assert status == 0, log
    assert committed_steps(killed) == [2, 4, 6]

    expected = load_file(str(Path(reference.sft.save_path) / "model.safetensors"))
    actual = load_file(str(Path(killed.sft.save_path) / "model.safetensors"))
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype == torch.float32, name  # bf16 is autocast only
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted bf16 run"
