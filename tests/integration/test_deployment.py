"""The deployment path, end to end: prefect.yaml -> `prefect deploy` -> a process worker -> `rlhf/sft`.

Real processes all the way: a Prefect server (private PREFECT_HOME, free loopback port), the
work pool and deployment made by the CLI from this repository's prefect.yaml, a `prefect worker`
subprocess that runs the flow from this checkout (pull step `set_working_directory`), a local Ray
cluster and DeepSpeed. The run trains the toy model for one epoch in chunks of 8 steps.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import PREFECT, PROJECT_DIR

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 360.0  # first DeepSpeed init JIT-builds an op (~80 s); a warm run takes ~30 s
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
UUID = re.compile(r"UUID: ([0-9a-f-]{36})")


def deployment_spec(name: str) -> dict:
    spec = yaml.safe_load((PROJECT_DIR / "prefect.yaml").read_text())
    return next(d for d in spec["deployments"] if d["name"] == name)


def run_config(tmp_path: Path, toy: dict[str, str]) -> dict:
    return {
        "run_name": "deploy-test",
        "stages": ["sft"],
        "ckpt_path": str(tmp_path / "ckpt"),
        "load_checkpoint": True,
        "seed": 42,
        "num_workers": 1,
        "sft": {
            "pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
            "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 1,
            "learning_rate": 1e-3, "save_steps": 8, "save_path": str(tmp_path / "out" / "sft"),
        },
    }


def wait_for_terminal_state(api_url: str, flow_run_id: str, worker, timeout: float):
    from prefect.client.orchestration import SyncPrefectClient

    deadline = time.monotonic() + timeout
    with SyncPrefectClient(api_url) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is not None and flow_run.state.type.value in TERMINAL_STATES:
                return flow_run
            assert worker.alive(), f"the worker exited (rc {worker.popen.returncode}):\n{worker.log_tail()}"
            assert time.monotonic() < deadline, (
                f"flow run {flow_run_id} still {flow_run.state.name if flow_run.state else None} "
                f"after {timeout:.0f} s\n{worker.log_tail()}")
            time.sleep(2)


def ppo_config(tmp_path: Path, toy: dict[str, str], sft_model: str) -> dict:
    return {
        "run_name": "deploy-test", "stages": ["ppo"], "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True,
        "ppo": {
            "pretrain": sft_model, "reward_fn": "rlhf_core.toy:gold_reward", "prompt_data": toy["prompts"],
            "input_key": "prompt", "advantage_estimator": "group_norm", "max_samples": 8, "n_samples_per_prompt": 2,
            "rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 4, "max_new_tokens": 8,
            "learning_rate": 1e-3, "save_steps": 1, "save_path": str(tmp_path / "out" / "ppo"),
        },
    }


def test_sft_then_ppo_deployments_run_on_a_process_worker(prefect_server, background, tmp_path):
    from prefect.client.orchestration import SyncPrefectClient
    from rlhf_core.toy import init_toy

    spec = deployment_spec("sft")
    pool = spec["work_pool"]["name"]
    assert spec["entrypoint"] == "flows/pipeline.py:rlhf"

    prefect_server.cli("work-pool", "create", pool, "--type", "process")
    # PWD: what a shell sets after `cd`; prefect.yaml records it as the project folder at deploy time.
    prefect_server.cli("--no-prompt", "deploy", "--all", cwd=PROJECT_DIR, env={"PWD": str(PROJECT_DIR)})

    with SyncPrefectClient(prefect_server.api_url) as client:
        deployment = client.read_deployment_by_name("rlhf/sft")
    assert deployment.work_pool_name == pool
    assert deployment.entrypoint == "flows/pipeline.py:rlhf"
    assert [next(iter(step)) for step in deployment.pull_steps] == ["prefect.deployments.steps.set_working_directory"]
    assert deployment.job_variables["env"]["RLHF_PROJECT_DIR"] == str(PROJECT_DIR)
    assert deployment.parameters["config"]["stages"] == ["sft"]

    # The worker starts elsewhere on purpose: the pull step, not the worker's cwd, finds the code.
    worker_dir = tmp_path / "worker"
    worker_dir.mkdir()
    worker_env = {**prefect_server.env, "PREFECT_WORKER_QUERY_SECONDS": "2"}  # pick the run up quickly
    worker = background("prefect-worker", [PREFECT, "worker", "start", "--pool", pool], worker_env, cwd=worker_dir)

    toy = init_toy(str(tmp_path / "toy"))
    config = run_config(tmp_path, toy)
    started = prefect_server.cli("deployment", "run", "rlhf/sft", "--param", f"config={json.dumps(config)}")
    match = UUID.search(started.stdout)
    assert match, f"no flow run id in:\n{started.stdout}"

    flow_run = wait_for_terminal_state(prefect_server.api_url, match.group(1), worker, RUN_TIMEOUT)
    assert flow_run.state.type.value == "COMPLETED", (
        f"flow run ended {flow_run.state.name}: {flow_run.state.message}\n{worker.log_tail()}")

    stage_dir = tmp_path / "ckpt" / config["run_name"] / "sft"
    committed = sorted(p.parent.name for p in stage_dir.glob("step_*/MANIFEST.json"))
    assert committed, f"no committed checkpoint under {stage_dir}: {sorted(p.name for p in stage_dir.glob('*'))}"
    assert (stage_dir / "latest").read_text().strip() in committed
    save_path = Path(config["sft"]["save_path"])
    assert (save_path / "config.json").is_file() and (save_path / "model.safetensors").is_file(), (
        f"no exported model at {save_path}: {sorted(p.name for p in save_path.glob('*'))}")

    # rlhf/ppo on the same worker, from the model the SFT deployment just exported.
    with SyncPrefectClient(prefect_server.api_url) as client:
        assert {d.name for d in client.read_deployments()} >= {"sft", "rm", "ppo", "full"}
    config = ppo_config(tmp_path, toy, str(save_path))
    started = prefect_server.cli("deployment", "run", "rlhf/ppo", "--param", f"config={json.dumps(config)}")
    flow_run = wait_for_terminal_state(prefect_server.api_url, UUID.search(started.stdout).group(1), worker,
                                       RUN_TIMEOUT)
    assert flow_run.state.type.value == "COMPLETED", (
        f"flow run ended {flow_run.state.name}: {flow_run.state.message}\n{worker.log_tail()}")
    ppo_dir = tmp_path / "ckpt" / "deploy-test" / "ppo"
    assert sorted(p.parent.name for p in ppo_dir.glob("step_*/MANIFEST.json")) == ["step_1", "step_2"]
    assert (tmp_path / "out" / "ppo" / "model.safetensors").is_file()
