"""The fault matrix: SIGKILL the training job at every point where a crash can hurt, on a local folder
(where each kill is also a power cut) and on a real S3 endpoint; each time rerun it. No committed checkpoint is ever lost, and the final
weights equal those of a run never interrupted.

One chain per backend: all fault points are armed at once, each fires once (a marker file remembers
it), so run k dies at the k-th point it reaches and run k+1 resumes from what run k committed. The
two chains run side by side, their jobs on one long-lived Ray cluster (the pytest process's `ray start --head`,
`worker_ray_head`), as on a real cluster where the job dies and Ray stays; test_kill_resume kills a job that
owns a local Ray instead.

The stages added after SFT (DPO, PRM) each run a shorter chain (STAGE_FAULT_POINTS) on a local folder, side by
side, against an uninterrupted run of their own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import fsspec
import pytest
from safetensors.torch import load

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from tests.conftest import make_bucket, s3_environment

pytestmark = pytest.mark.slow

# In the order a run reaches them (save_steps 5, max_ckpt_num 2). Each lies on the chain's way forward, never only
# on a rerun that trains again a chunk retention removed: after_commit@5, in its place before, fired only because
# the run after during_removal@5 found step_5 incomplete and trained steps 1-5 again from scratch.
FAULT_POINTS = [
    "train_step@3",        # inside a training step (Ray worker), before any checkpoint
    "local_save@5",        # the in-memory snapshot: DeepSpeed state written, HF copy not yet
    "between_uploads@5",   # background writer: first file uploaded, the rest not
    "before_manifest@5",   # every file uploaded, no MANIFEST.json
    "before_latest@5",     # MANIFEST.json written, `latest` never yet written
    "train_step@8",        # mid-chunk, one checkpoint behind
    "mid_upload@10",       # background writer, while step 11 trains: a file half hashed and uploaded
    "before_manifest@15",
    "after_commit@15",     # committed, retention not yet run: steps 5, 10 and 15 all on the store
    "local_save@20",
    "during_removal@5",    # the commit of step 20 retains 2: step_5's manifest deleted, its files not yet
    "before_latest@25",
]

def sft_run(toy: dict[str, str], ckpt: str, save_path: str) -> RunConfig:
    """`train_sft_args` (whose uninterrupted weights are `reference_sft_weights`) with max_ckpt_num 2."""
    return RunConfig(
        ckpt_path=ckpt, load_checkpoint=True, max_ckpt_num=2, seed=42,
        sft=SFTConfig(pretrain=toy["model"], dataset=toy["sft"], input_key="prompt", output_key="response",
                      max_len=128, train_batch_size=8, micro_train_batch_size=4, max_epochs=1, input_template="{}",
                      learning_rate=1e-3, save_steps=5, save_path=save_path),
    )


def run_job(run: RunConfig, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                          env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])


def committed_steps(run: RunConfig) -> list[int]:
    (stage,) = run.stages  # one training stage per chain
    return [info.step for info in CheckpointStore(run.stage_url(stage)).list(verify=True) if info.is_committed]


def run_chain(run: RunConfig, env: dict[str, str], faults_dir: Path, points: list[str],
              after_death: Callable[[], None] = lambda: None) -> int:
    """Rerun the job until it completes; check the invariants after every death (and `after_death`, e.g. a
    power cut). Returns the deaths."""
    env = {**env, "RLHF_FAULT_INJECT": ",".join(f"{point}=kill" for point in points),
           "RLHF_FAULT_STATE": str(faults_dir)}
    num_deaths = 0
    for _ in range(len(points) + 1):
        before = committed_steps(run)
        job = run_job(run, env)
        if job.returncode == -9:
            after_death()
        after = committed_steps(run)
        if before:  # retention only ever drops the oldest; the newest committed is never lost
            assert after and after[-1] >= before[-1], (before, after)
            assert set(before[-run.max_ckpt_num:]) <= set(after) or after[-1] > before[-1], (before, after)
        if job.returncode == 0:
            return num_deaths
        assert job.returncode == -9, f"the job failed by itself (rc {job.returncode}):\n{job.stderr[-4000:]}"
        num_deaths += 1
    raise AssertionError("the job never completed")


def read_weights(url: str) -> dict:
    with fsspec.open(f"{url}/model.safetensors", "rb") as handle:
        return load(handle.read())


def check_chain(run, env, faults_dir, points, reference_weights, weights_url, after_death=lambda: None):
    num_deaths = run_chain(run, env, faults_dir, points, after_death)
    fired = sorted(path.name for path in faults_dir.iterdir())
    assert fired == sorted(points), f"never reached: {set(points) - set(fired)}"
    assert num_deaths == len(points)
    actual = read_weights(weights_url)
    for name, tensor in reference_weights.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"


def failed_chains(futures: dict) -> dict:
    """Each chain's AssertionError, by its name, after waiting for every chain (one failing must not hide another's
    result)."""
    failures = {}
    for name, future in futures.items():
        try:
            future.result()
        except AssertionError as error:
            failures[name] = error
    return failures


POWER_CUTS_POSSIBLE = Path("/dev/fuse").exists() and shutil.which("fusermount3") is not None


def test_fault_matrix_on_s3_and_on_a_local_folder_with_power_cuts(toy_assets, rlhf_env, tmp_path,
                                                                  reference_sft_weights, s3_endpoint, monkeypatch):
    """Both chains at all of FAULT_POINTS, side by side. The local chain's store sits on the power-cut filesystem
    (tests/powercut_fs.py): each kill is also a power cut, which drops every write and rename no fsync made
    durable. After each one the newest commit made before it is still there (the store without fsyncs fails
    here: the cut takes every commit), every step listed as committed verifies, and `latest` names one of them.
    POWERCUT_TORN_WRITES=1 runs it with torn writes (a cut keeps the first half of each un-fsync'd write).
    Without FUSE (.ci/run installs fuse3) the local chain runs on a plain folder, with a warning.
    Slow (115-270 s): 13 jobs per chain, each a process with its own start-up (imports, joining Ray, the rank's
    set-up), which is most of each job; the two chains share the cores."""
    from tests.powercut_fs import PowerCutMount

    assert len(FAULT_POINTS) >= 12
    bucket = f"rlhf-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    for name, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(name, value)  # so this process reads the same store
    local_root = tmp_path / "mnt" if POWER_CUTS_POSSIBLE else tmp_path
    local_run = sft_run(toy_assets, str(local_root / "ckpt"), str(tmp_path / "model"))
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        local_after_death = lambda: None  # noqa: E731
        if POWER_CUTS_POSSIBLE:
            disk = stack.enter_context(PowerCutMount(tmp_path / "backing", local_root, tmp_path / "powercut-fs.log"))
            local_after_death = partial(cut_and_check, local_run, disk)
        else:
            warnings.warn("no /dev/fuse or fusermount3: the local chain ran without power cuts", stacklevel=1)
        chains = {
            "local folder": (local_run, rlhf_env, str(tmp_path / "model"), local_after_death),
            "s3": (sft_run(toy_assets, f"s3://{bucket}/ckpt", f"s3://{bucket}/model"),
                   {**rlhf_env, **s3_environment(s3_endpoint)}, f"s3://{bucket}/model", lambda: None),
        }
        futures = {}
        for backend, (run, env, weights_url, after_death) in chains.items():
            faults_dir = tmp_path / f"faults-{backend.replace(' ', '-')}"
            faults_dir.mkdir()
            futures[backend] = pool.submit(check_chain, run, env, faults_dir, FAULT_POINTS, reference_sft_weights,
                                           weights_url, after_death)
        failures = failed_chains(futures)
    assert not failures, "\n\n".join(f"[{backend}] {error}" for backend, error in failures.items())


def cut_and_check(run: RunConfig, disk) -> None:
    """Cut the power under the store of `run`'s dead job; no commit may be lost, and the store's listing and
    `latest` must agree with what verifies."""
    before_cut = committed_steps(run)
    disk.cut()
    after_cut = committed_steps(run)
    assert after_cut[-1:] == before_cut[-1:], f"the cut lost a commit: {before_cut} -> {after_cut}"
    store = CheckpointStore(run.stage_url("sft"))
    listed = [info.step for info in store.list(verify=False) if info.is_committed]
    assert listed == committed_steps(run), f"listed as committed but not verifying: {listed}"
    latest = store.latest_name()
    assert latest is None or int(latest.removeprefix("step_")) in listed, (latest, listed)


# A shorter chain for each stage added after SFT (save_steps 4, 12 steps, max_ckpt_num 2), in the order reached:
# the crash points of a commit are the store's and the rank's, shared by every stage, so each stage's chain needs
# only to show that its own state (DPO's frozen reference, PRM's placeholder labels) resumes through them.
STAGE_FAULT_POINTS = ["train_step@2", "between_uploads@4", "before_latest@4", "train_step@6", "mid_upload@8",
                      "during_removal@4"]


def stage_run(stage: str, toy: dict[str, str], data_dir: Path, root: Path) -> RunConfig:
    """12 steps of `stage` from the toy model on one rank, in chunks of 4."""
    from rlhf_core.stages.dpo import DPOConfig
    from rlhf_core.stages.prm import PRMConfig
    from rlhf_core.toy import STEP_PLACEHOLDER, step_labelled_rows

    common = {"pretrain": toy["model"], "max_epochs": 1, "save_steps": 4, "save_path": str(root / "model")}
    if stage == "dpo":
        config = DPOConfig(dataset=toy["prefs"], prompt_key="prompt", eval_holdout=0.0, max_len=64, max_samples=96,
                           train_batch_size=8, micro_train_batch_size=4, learning_rate=5e-4, beta=0.1, **common)
    else:
        rows = data_dir / "steps.jsonl"
        if not rows.exists():
            rows.write_text("".join(json.dumps(row) + "\n" for row in step_labelled_rows(192, 0)))
        config = PRMConfig(dataset=str(rows), input_key="input", label_key="value", placeholder_token=STEP_PLACEHOLDER,
                           reward_tokens=["1", "0"], max_len=32, train_batch_size=16, micro_train_batch_size=8,
                           learning_rate=2e-3, **common)
    return RunConfig(stages=[stage], ckpt_path=str(root / "ckpt"), load_checkpoint=True, max_ckpt_num=2, seed=7,
                     **{stage: config})


def test_the_dpo_and_prm_stages_survive_a_fault_chain(toy_assets, rlhf_env, tmp_path):
    """DPO and PRM each through STAGE_FAULT_POINTS on a local folder, side by side on one Ray cluster: no commit
    lost, and the final weights equal an uninterrupted run's. Slow (85-150 s): 2 references and 2 x 7 jobs, each paying
    its own start-up."""
    stages = ("dpo", "prm")
    references = {stage: stage_run(stage, toy_assets, tmp_path, tmp_path / f"{stage}-reference") for stage in stages}
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(stages, pool.map(lambda stage: run_job(references[stage], rlhf_env), stages)))
    for stage, job in done.items():
        assert job.returncode == 0, f"{stage} reference:\n{job.stderr[-3000:]}"
    with ThreadPoolExecutor(2) as pool:
        futures = {}
        for stage in stages:
            run = stage_run(stage, toy_assets, tmp_path, tmp_path / f"{stage}-chain")
            faults_dir = tmp_path / f"faults-{stage}"
            faults_dir.mkdir()
            weights = read_weights(references[stage].stage_config(stage).save_path)
            futures[stage] = pool.submit(check_chain, run, rlhf_env, faults_dir, STAGE_FAULT_POINTS, weights,
                                         run.stage_config(stage).save_path)
        failures = failed_chains(futures)
    assert not failures, "\n\n".join(f"[{stage}] {error}" for stage, error in failures.items())

