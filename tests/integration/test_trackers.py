"""Trackers across a kill: an SFT job on the toy with --use_tensorboard and --use_wandb (offline) is
SIGKILLed inside its second chunk, after it logged a step past its first checkpoint, and run again
with --load_checkpoint. TensorBoard must show every logged step once, the checkpoints must record the
tracker ids, and the resumed job must continue the same wandb run.

Real processes: the job is tests.integration.fault_driver (chunks through rlhf_core, no Prefect) on
a local Ray with DeepSpeed, as the PPO kill test in test_pipeline_stages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig

pytestmark = pytest.mark.slow
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def run_job(run: RunConfig, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                          env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])


def metadata(run: RunConfig, step: int) -> dict:
    return json.loads((Path(run.stage_url("sft")) / f"step_{step}" / "training_metadata.json").read_text())


def raw_steps(log_dir: Path, tag: str) -> list[int]:
    """Every point written for `tag`, in file order, duplicates included (what TensorBoard purges is still on disk)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


def test_killed_run_resumes_the_same_tracker_runs_and_logs_each_step_once(toy_assets, rlhf_env, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_root, wandb_dir = tmp_path / "tb", tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {**rlhf_env, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    run = RunConfig(
        run_name="tracked", ckpt_path=str(tmp_path / "ckpt"), load_checkpoint=True, max_ckpt_num=0,
        use_tensorboard=str(tb_root), use_wandb=True, wandb_project="toy",
        sft=SFTConfig(pretrain=toy_assets["model"], dataset=toy_assets["sft"], input_key="prompt",
                      output_key="response", max_len=64, max_samples=80, train_batch_size=8,
                      micro_train_batch_size=4, max_epochs=1, learning_rate=1e-3, save_steps=5, logging_steps=2,
                      save_path=str(tmp_path / "out")),
    )
    # Steps 2 and 4 logged and step_5 committed; step 6 logged; killed about to train step 8.
    (tmp_path / "faults").mkdir()
    killed = run_job(run, {**env, "RLHF_FAULT_INJECT": "train_step@8=kill",
                           "RLHF_FAULT_STATE": str(tmp_path / "faults")})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (Path(run.stage_url("sft")) / "step_5").exists() and not (Path(run.stage_url("sft")) / "step_10").exists()
    log_dir = tb_root / "tracked" / "sft"
    assert raw_steps(log_dir, "train/loss") == [2, 4, 6]
    first_ids = metadata(run, 5)["trackers"]
    assert first_ids["tensorboard_dir"] == str(log_dir) and first_ids["wandb_run_id"]

    resumed = run_job(run, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metadata(run, 10)["trackers"] == first_ids

    # On disk step 6 is there twice (before the kill, and retrained); TensorBoard shows it once,
    # with the retrained value, thanks to the resumed writer's purge_step.
    assert raw_steps(log_dir, "train/loss") == [2, 4, 6, 6, 8, 10]
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    for tag in ("train/loss", "train/lr"):
        assert [event.step for event in accumulator.Scalars(tag)] == [2, 4, 6, 8, 10], tag
    assert accumulator.Scalars("train/loss")[-1].value == pytest.approx(metadata(run, 10)["metrics"]["loss"])

    offline_runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2, offline_runs
    for folder in offline_runs:
        assert folder.name.endswith(first_ids["wandb_run_id"]) or f"{first_ids['wandb_run_id']}-" in folder.name
        assert (folder / f"run-{first_ids['wandb_run_id']}.wandb").is_file()
