"""The deployment path, end to end: prefect.yaml -> `prefect deploy` -> a process worker -> the flow `rlhf`.

Real processes all the way: a Prefect server (private PREFECT_HOME, free loopback port), the work pool
and deployments made by the CLI from this repository's prefect.yaml (`deployed`, once per module), a
`prefect worker` subprocess that runs the flow from this checkout (pull step `set_working_directory`),
a Ray head the flow runs join (RAY_ADDRESS, one head per pytest process) and DeepSpeed, on the toy model
with chunks of a few steps.

- `rlhf/sft` then `rlhf/ppo`: checkpoints and exported models land where the config says.
- `rlhf/prm`: its parameters are prefect.yaml's; on step-labelled toy rows it commits a checkpoint per chunk
  and exports the model.
- `rlhf/full` (sft -> rm -> ppo -> merge -> export, tiny): one subflow run per stage; through the API,
  each training stage's progress artifact at 100, a chunk table row per chunk, the checkpoint links,
  the curve embedded as a PNG data URI (also saved in the run folder); the `rlhf.checkpoint.committed`
  events with size and URI, and no `rlhf.alert.*` event. The worker's terminal gets the quiet console
  (no Ray actor lines; they are in the run folder's logs/driver.log).
- `rlhf/ppo-nightly` with `max_chunks_per_run: 1` on a 2-chunk stage: the first run stops at its
  budget (Completed, not exported), a run started while it is active is cancelled (deployment
  concurrency limit 1, CANCEL_NEW), the next run sets a half-written step aside (log line and
  `rlhf.checkpoint.set-aside` event), continues, and exports the same weights, bit for bit, as the
  unbudgeted `rlhf/full` run's stage. Its checkpoint-size tolerance is set tight on purpose: the
  `rlhf.alert.checkpoint-size` event of its first commit is read back through the events API, once
  (the second commit repeats the same anomaly), as its alerts.jsonl has it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.integration.conftest import (PREFECT, PROJECT_DIR, BackgroundProcess, PrefectServer, engine_process,
                                       flow_run_process)
from rlhf_core.toy import step_labelled_rows

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 360.0  # first DeepSpeed init JIT-builds an op (~80 s); a warm run takes ~30 s
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
UUID = re.compile(r"UUID: ([0-9a-f-]{36})")


def deployment_spec(name: str) -> dict:
    spec = yaml.safe_load((PROJECT_DIR / "prefect.yaml").read_text())
    return next(d for d in spec["deployments"] if d["name"] == name)


def sft_section(toy: dict[str, str], save_path: Path, save_steps: int = 8) -> dict:
    return {"pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
            "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 1,
            "learning_rate": 1e-3, "save_steps": save_steps, "save_path": str(save_path)}


def run_config(tmp_path: Path, toy: dict[str, str]) -> dict:
    return {"run_name": "deploy-test", "stages": ["sft"], "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True,
            "seed": 42, "num_workers": 1, "sft": sft_section(toy, tmp_path / "out" / "sft")}


def ppo_section(toy: dict[str, str], pretrain: str, save_path: Path, **extra) -> dict:
    return {"pretrain": pretrain, "reward_fn": "rlhf_core.toy:gold_reward", "prompt_data": toy["prompts"],
            "input_key": "prompt", "advantage_estimator": "group_norm", "max_samples": 8, "n_samples_per_prompt": 2,
            "rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 4, "max_new_tokens": 8,
            "learning_rate": 1e-3, "save_steps": 1, "save_path": str(save_path), **extra}


def ppo_config(tmp_path: Path, toy: dict[str, str], sft_model: str) -> dict:
    return {"run_name": "deploy-test", "stages": ["ppo"], "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True,
            "ppo": ppo_section(toy, sft_model, tmp_path / "out" / "ppo")}


def full_config(workdir: Path, toy: dict[str, str]) -> dict:
    """sft (2 chunks) -> rm (2 chunks) -> ppo with LoRA (2 chunks) -> merge -> export, as small as they go."""
    out = workdir / "out"
    return {
        "run_name": "deploy-full", "stages": ["sft", "rm", "ppo", "merge", "export"],
        "ckpt_path": str(workdir / "ckpt"), "load_checkpoint": True, "seed": 42, "num_workers": 1,
        "sft": sft_section(toy, out / "sft", save_steps=16),
        "rm": {"dataset": toy["prefs"], "prompt_key": "prompt", "max_len": 64, "max_samples": 64, "train_batch_size": 16,
               "micro_train_batch_size": 8, "max_epochs": 1, "learning_rate": 1e-3, "save_steps": 2,
               "save_path": str(out / "rm")},
        "ppo": {key: value for key, value in ppo_section(toy, "", out / "ppo_lora", lora_rank=8).items()
                if key != "pretrain"},  # default: this run's SFT output
        "merge": {"output_path": str(out / "merged")},
        "export": {"save_path": str(out / "final")},
    }


@dataclass
class Deployed:
    """The server, the work pool and deployments from prefect.yaml, and a worker polling the pool."""

    server: PrefectServer
    pool: str
    worker: BackgroundProcess
    toy: dict[str, str]
    workdir: Path

    def run(self, deployment: str, config: dict) -> str:
        """`prefect deployment run DEPLOYMENT --param config=...`; returns the flow run id."""
        started = self.server.cli("deployment", "run", deployment, "--param", f"config={json.dumps(config)}")
        match = UUID.search(started.stdout)
        assert match, f"no flow run id in:\n{started.stdout}"
        return match.group(1)

    def wait(self, flow_run_id: str, timeout: float = RUN_TIMEOUT):
        return wait_for_terminal_state(self.server.api_url, flow_run_id, self.worker, timeout)

    def run_to_completion(self, deployment: str, config: dict):
        flow_run = self.wait(self.run(deployment, config))
        assert flow_run.state.type.value == "COMPLETED", (
            f"flow run ended {flow_run.state.name}: {flow_run.state.message}\n{self.worker.log_tail()}")
        return flow_run


@pytest.fixture(scope="module")
def deployed(prefect_server, worker_ray_head, tmp_path_factory) -> Iterator[Deployed]:
    """`prefect work-pool create`, `prefect deploy --all` from the project folder, and `prefect worker start`
    from another folder: the pull step, not the worker's cwd, finds the code. The worker's flow runs join this
    pytest process's Ray head (RAY_ADDRESS in the worker's environment, as on a cluster), not a local Ray each."""
    from rlhf_core.toy import init_toy

    pool = deployment_spec("sft")["work_pool"]["name"]
    prefect_server.cli("work-pool", "create", pool, "--type", "process")
    # PWD: what a shell sets after `cd`; prefect.yaml records it as the project folder at deploy time.
    prefect_server.cli("--no-prompt", "deploy", "--all", cwd=PROJECT_DIR, env={"PWD": str(PROJECT_DIR)})
    workdir = tmp_path_factory.mktemp("deployed")
    (workdir / "worker").mkdir()
    worker_env = {**prefect_server.env, "PREFECT_WORKER_QUERY_SECONDS": "2",  # pick runs up quickly
                  "RAY_ADDRESS": worker_ray_head}
    worker = BackgroundProcess.start("prefect-worker", [PREFECT, "worker", "start", "--pool", pool], worker_env,
                                     workdir / "logs" / "prefect-worker.log", cwd=workdir / "worker")
    try:
        yield Deployed(prefect_server, pool, worker, init_toy(str(workdir / "toy")), workdir)
    finally:
        worker.stop()


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


def test_sft_then_ppo_deployments_run_on_a_process_worker(deployed, tmp_path):
    from prefect.client.orchestration import SyncPrefectClient

    spec = deployment_spec("sft")
    assert spec["entrypoint"] == "flows/pipeline.py:rlhf"
    with SyncPrefectClient(deployed.server.api_url) as client:
        deployment = client.read_deployment_by_name("rlhf/sft")
        assert {d.name for d in client.read_deployments()} >= {"sft", "rm", "dpo", "prm", "ppo", "full",
                                                             "ppo-nightly"}
    assert deployment.work_pool_name == deployed.pool
    assert deployment.entrypoint == "flows/pipeline.py:rlhf"
    assert [next(iter(step)) for step in deployment.pull_steps] == ["prefect.deployments.steps.set_working_directory"]
    assert deployment.job_variables["env"]["RLHF_PROJECT_DIR"] == str(PROJECT_DIR)
    assert deployment.job_variables["working_dir"] == str(PROJECT_DIR)  # every attempt: one import path, its spares
    assert deployment.job_variables["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "rlhf_core"
    assert deployment.parameters["config"]["stages"] == ["sft"]

    config = run_config(tmp_path, deployed.toy)
    deployed.run_to_completion("rlhf/sft", config)
    stage_dir = tmp_path / "ckpt" / config["run_name"] / "sft"
    committed = sorted(p.parent.name for p in stage_dir.glob("step_*/MANIFEST.json"))
    assert committed, f"no committed checkpoint under {stage_dir}: {sorted(p.name for p in stage_dir.glob('*'))}"
    assert (stage_dir / "latest").read_text().strip() in committed
    save_path = Path(config["sft"]["save_path"])
    assert (save_path / "config.json").is_file() and (save_path / "model.safetensors").is_file(), (
        f"no exported model at {save_path}: {sorted(p.name for p in save_path.glob('*'))}")

    # rlhf/ppo on the same worker, from the model the SFT deployment just exported.
    deployed.run_to_completion("rlhf/ppo", ppo_config(tmp_path, deployed.toy, str(save_path)))
    ppo_dir = tmp_path / "ckpt" / "deploy-test" / "ppo"
    assert sorted(p.parent.name for p in ppo_dir.glob("step_*/MANIFEST.json")) == ["step_1", "step_2"]
    assert (tmp_path / "out" / "ppo" / "model.safetensors").is_file()


def test_dpo_deployment_and_a_full_run_that_takes_dpo(deployed, tmp_path):
    """`rlhf/dpo` trains DPO from a model; `rlhf/full` given the stages sft -> dpo (LoRA) -> merge -> export
    chains them: DPO starts from this run's SFT output, the merge takes DPO's adapter, the export the merge."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(deployed.server.api_url) as client:
        assert client.read_deployment_by_name("rlhf/dpo").parameters["config"]["stages"] == ["dpo"]
    dpo = {"dataset": deployed.toy["prefs"], "prompt_key": "prompt", "max_len": 64, "max_samples": 32,
           "train_batch_size": 8, "micro_train_batch_size": 8, "max_epochs": 1, "learning_rate": 5e-4, "save_steps": 2}
    alone = {"run_name": "deploy-dpo", "stages": ["dpo"], "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True,
             "dpo": {**dpo, "pretrain": deployed.toy["model"], "save_path": str(tmp_path / "out" / "dpo")}}
    deployed.run_to_completion("rlhf/dpo", alone)
    assert (tmp_path / "out" / "dpo" / "model.safetensors").is_file()

    out = tmp_path / "full"
    chained = {"run_name": "deploy-sft-dpo", "stages": ["sft", "dpo", "merge", "export"],
               "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True, "seed": 42,
               "sft": sft_section(deployed.toy, out / "sft", save_steps=16),
               "dpo": {**dpo, "lora_rank": 8, "save_path": str(out / "dpo_lora")},
               "merge": {"output_path": str(out / "merged")}, "export": {"save_path": str(out / "final")}}
    deployed.run_to_completion("rlhf/full", chained)
    assert (out / "dpo_lora" / "adapter_config.json").is_file()
    assert (out / "final" / "model.safetensors").is_file()
    dpo_steps = sorted(p.parent.name for p in (tmp_path / "ckpt" / "deploy-sft-dpo" / "dpo").glob("step_*/MANIFEST.json"))
    assert dpo_steps, "DPO committed no checkpoint in the full run"
    assert (out / "merged" / "model.safetensors").is_file()


def test_prm_deployment_trains_a_process_reward_model(deployed, tmp_path):
    """`rlhf/prm`, deployed with its parameters from prefect.yaml, trains PRM from the toy model on step-labelled
    rows (prefect.yaml's prm section with the data, the model and the sizes overridden): it commits a checkpoint
    per chunk and exports the model."""
    from prefect.client.orchestration import SyncPrefectClient

    spec = deployment_spec("prm")
    with SyncPrefectClient(deployed.server.api_url) as client:
        deployment = client.read_deployment_by_name("rlhf/prm")
    assert deployment.parameters["config"] == spec["parameters"]["config"]
    assert deployment.parameters["config"]["stages"] == ["prm"]
    assert deployment.work_pool_name == deployed.pool and set(deployment.tags) == {"rlhf", "prm"}

    data = tmp_path / "steps.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in step_labelled_rows(32, seed=0)))
    prm = {**spec["parameters"]["config"]["prm"], "pretrain": deployed.toy["model"], "dataset": str(data),
           "train_batch_size": 8, "micro_train_batch_size": 8, "max_epochs": 1, "save_steps": 2,
           "save_path": str(tmp_path / "out" / "prm")}  # its input_key, label_key and tokens: prefect.yaml's
    config = {"run_name": "deploy-prm", "stages": ["prm"], "ckpt_path": str(tmp_path / "ckpt"),
              "load_checkpoint": True, "seed": 42, "prm": prm}
    deployed.run_to_completion("rlhf/prm", config)
    stage_dir = tmp_path / "ckpt" / "deploy-prm" / "prm"
    assert sorted(p.parent.name for p in stage_dir.glob("step_*/MANIFEST.json")) == ["step_2", "step_4"]
    assert (stage_dir / "latest").read_text().strip() == "step_4"
    assert (tmp_path / "out" / "prm" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- rlhf/full as an operator sees it


TRAINING_STAGES = ("sft", "rm", "ppo")


@pytest.fixture(scope="module")
def full_run(deployed):
    """`rlhf/full` run once, unbudgeted (the reference of the budgeted runs): (flow run, config)."""
    config = full_config(deployed.workdir / "full", deployed.toy)
    return deployed.run_to_completion("rlhf/full", config), config


def child_flow_runs(client, parent_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    # A subflow's parent_task_run belongs to the parent flow run (the API filters on that task run).
    children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return {child.name: child for child in children}


def latest_artifacts(client, flow_run_id) -> dict:
    """The newest artifact of each key created by one flow run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    newest = {}
    for artifact in sorted(found, key=lambda artifact: artifact.created):
        newest[artifact.key] = artifact
    return newest


def flow_run_log(client, flow_run_id, waiting_for: str = "", timeout: float = 30.0) -> str:
    """The messages logged by one flow run; with `waiting_for`, until that text is among them (a flow-run
    process sends its logs in batches, the last ones as it exits, after its run is already Completed)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        text = "\n".join(log.message for log in logs)
        if waiting_for in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def read_events_eventually(api_url: str, name: str, resource_prefix: str, expected: int, timeout: float = 30.0,
                           name_prefix: bool = False):
    """Events named `name` (or, with `name_prefix`, whose names start with it) on resources starting with
    `resource_prefix`; waits until `expected` have arrived (the flow-run process sends them over a
    websocket, the server stores them a moment later)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    names = EventNameFilter(prefix=[name]) if name_prefix else EventNameFilter(name=[name])
    deadline = time.monotonic() + timeout
    with SyncPrefectClient(api_url) as client:
        while True:
            page = client.read_events(filter=EventFilter(event=names,
                                                         resource=EventResourceFilter(id_prefix=[resource_prefix])), limit=50)
            if len(page.events) >= expected or time.monotonic() > deadline:
                return page.events
            time.sleep(1)


def test_full_deployment_shows_each_stage_as_a_subflow_with_artifacts_logs_and_events(deployed, full_run):
    from prefect.client.orchestration import SyncPrefectClient

    flow_run, config = full_run
    run_dir = Path(config["ckpt_path"]) / config["run_name"]
    with SyncPrefectClient(deployed.server.api_url) as client:
        children = child_flow_runs(client, flow_run.id)
        assert sorted(children) == sorted(f"deploy-full-{stage}" for stage in config["stages"])
        assert {child.state.type.value for child in children.values()} == {"COMPLETED"}
        committed = {}
        for stage in TRAINING_STAGES:
            child = children[f"deploy-full-{stage}"]
            committed[stage] = sorted(int(p.parent.name.removeprefix("step_"))
                                      for p in (run_dir / stage).glob("step_*/MANIFEST.json"))
            check_stage_artifacts(latest_artifacts(client, child.id), config, stage, committed[stage])
            num_chunks = len(committed[stage])
            progress = f"{stage} [##########] {num_chunks}/{num_chunks} chunks"
            log = flow_run_log(client, child.id, waiting_for=progress)
            assert progress in log, log[-3000:]
            assert "placed 1 of 1 ranks" in log, f"rlhf_core's log does not reach the run (extra loggers):\n{log[-3000:]}"
        for stage in ("merge", "export"):
            links = latest_artifacts(client, children[f"deploy-full-{stage}"].id)
            output = config[stage]["save_path" if stage == "export" else "output_path"]
            assert links[f"deploy-full-{stage}-output"].data == f"[{output}]({output})"
    assert committed["sft"] == [16, 32] and committed["ppo"] == [1, 2] and len(committed["rm"]) >= 2
    curve = (run_dir / "sft-curve.svg").read_bytes()
    assert curve.startswith(b"<svg") and b"sft: loss" in curve

    num_commits = sum(len(steps) for steps in committed.values())
    events = read_events_eventually(deployed.server.api_url, "rlhf.checkpoint.committed", "rlhf.run.deploy-full.",
                                    num_commits)
    seen = sorted((event.payload["stage"], event.payload["step"]) for event in events)
    assert seen == sorted((stage, step) for stage, steps in committed.items() for step in steps)
    for event in events:
        payload = event.payload
        assert payload["run"] == "deploy-full" and payload["uri"] == str(run_dir / payload["stage"] / f"step_{payload['step']}")
        assert payload["size_bytes"] > 0, payload
    # A healthy run raises no alert (its events are emitted with the commits' just read).
    alerts = read_events_eventually(deployed.server.api_url, "rlhf.alert.", "rlhf.run.deploy-full.", 0, name_prefix=True)
    assert [event.payload for event in alerts] == [] and not (run_dir / "alerts.jsonl").exists()

    # The worker's flow-run process set up the quiet console: the Ray actors' output went to the run folder's
    # log file, not to the worker's terminal (the worker relays its flow runs' output into its own log).
    assert "(TrainWorker pid=" in (run_dir / "logs" / "driver.log").read_text()
    assert "(TrainWorker pid=" not in deployed.worker.log_path.read_text()


def check_stage_artifacts(artifacts: dict, config: dict, stage: str, committed_steps: list[int]) -> None:
    import base64

    key = f"deploy-full-{stage}"
    assert artifacts[f"{key}-progress"].type == "progress" and float(artifacts[f"{key}-progress"].data) == 100.0
    table = artifacts[f"{key}-chunks"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["step"] for row in rows] == committed_steps, rows
    assert all(row["status"].startswith("trained") for row in rows), rows
    links = artifacts[f"{key}-checkpoints"].data
    run_dir = Path(config["ckpt_path"]) / config["run_name"]
    for step in committed_steps:
        assert str(run_dir / stage / f"step_{step}") in links, links
    assert f"Exported model: [{config[stage]['save_path']}]" in links, links
    curve = re.search(r"!\[curve\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", artifacts[f"{key}-curve"].data)
    assert curve and base64.b64decode(curve.group(1)).startswith(b"<svg"), artifacts[f"{key}-curve"].data[:200]


# --------------------------------------------------------------------------- rlhf/ppo-nightly: budgets, schedule


def test_ppo_nightly_stops_at_its_chunk_budget_and_the_next_run_finishes_with_the_same_weights(deployed, full_run):
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(deployed.server.api_url) as client:
        deployment = client.read_deployment_by_name("rlhf/ppo-nightly")
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 2 * * *", False)]
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == "CANCEL_NEW"
    assert deployment.parameters["config"]["max_chunks_per_run"] == 1
    assert deployment.parameters["config"]["load_checkpoint"] is True

    _, full = full_run
    workdir = deployed.workdir / "nightly"
    config = {"run_name": "nightly", "stages": ["ppo"], "ckpt_path": str(workdir / "ckpt"), "load_checkpoint": True,
              "seed": 42, "num_workers": 1, "max_chunks_per_run": 1,
              "alert_size_tolerance": 1e-9,  # every checkpoint is "off" its predicted size: an alert on purpose
              # ... and on the same side: the tokenizer each checkpoint also saves (~2.5 KB, not predicted) puts
              # both steps above the prediction, not within the ~200 bytes their metadata and manifests differ by.
              "ppo": ppo_section(deployed.toy, full["sft"]["save_path"], workdir / "ppo_lora", lora_rank=8,
                                 save_hf_ckpt=True)}
    stage_dir, save_path = workdir / "ckpt" / "nightly" / "ppo", workdir / "ppo_lora"

    # Two runs at once: the deployment's concurrency limit (1, CANCEL_NEW) lets one start.
    both = [deployed.run("rlhf/ppo-nightly", config), deployed.run("rlhf/ppo-nightly", config)]
    ended = {run_id: deployed.wait(run_id) for run_id in both}
    states = sorted(flow_run.state.type.value for flow_run in ended.values())
    assert states == ["CANCELLED", "COMPLETED"], {run_id: r.state.name for run_id, r in ended.items()}
    first = next(run_id for run_id, flow_run in ended.items() if flow_run.state.type.value == "COMPLETED")
    assert sorted(p.parent.name for p in stage_dir.glob("step_*/MANIFEST.json")) == ["step_1"]
    assert not save_path.exists(), "a stage stopped by its budget was exported"
    with SyncPrefectClient(deployed.server.api_url) as client:
        stopped = "ppo: stopped at step 1/2 because the chunk budget (max_chunks_per_run) is spent"
        log = flow_run_log(client, child_flow_runs(client, first)["nightly-ppo"].id, waiting_for=stopped)
    assert stopped in log, log[-3000:]

    # A half-written step_2, as a run killed mid-save leaves it: the next run sets it aside (never deletes
    # it), says so in its log and as an event, and trains step 2 again from step 1.
    (stage_dir / "step_2").mkdir()
    (stage_dir / "step_2" / "partial.bin").write_bytes(b"cut short")
    second = deployed.run_to_completion("rlhf/ppo-nightly", config)
    assert sorted(p.parent.name for p in stage_dir.glob("step_*/MANIFEST.json")) == ["step_1", "step_2"]
    with SyncPrefectClient(deployed.server.api_url) as client:
        stage_run = child_flow_runs(client, second.id)["nightly-ppo"]
        rows = json.loads(latest_artifacts(client, stage_run.id)["nightly-ppo-chunks"].data)
        log = flow_run_log(client, stage_run.id, waiting_for="skipping checkpoint step_2 (incomplete")
    assert [row["status"] for row in rows] == ["cached", "trained 1 steps"], rows
    assert "skipping checkpoint step_2 (incomplete" in log, log[-3000:]  # rlhf_core's warning, in the run's log
    set_aside = read_events_eventually(deployed.server.api_url, "rlhf.checkpoint.set-aside", "rlhf.run.nightly.", 1)
    assert [(event.payload["step"], event.payload["reason"].split(":")[0]) for event in set_aside] == [(2, "incomplete")]
    assert (Path(set_aside[0].payload["uri"]) / "partial.bin").read_bytes() == b"cut short"

    # The size alert of step 1, through the events API, once: step 2 repeats the same anomaly (the same
    # findings as step 1), so it raises nothing, in the events as in alerts.jsonl.
    read_events_eventually(deployed.server.api_url, "rlhf.checkpoint.committed", "rlhf.run.nightly.", 2)
    alert_events = read_events_eventually(deployed.server.api_url, "rlhf.alert.", "rlhf.run.nightly.", 1,
                                          name_prefix=True)
    assert [(event.event, event.resource.id, event.payload["stage"], event.payload["step"])
            for event in alert_events] == [("rlhf.alert.checkpoint-size", "rlhf.run.nightly.ppo", "ppo", 1)]
    assert "predict" in alert_events[0].payload["message"], alert_events[0].payload
    logged = [json.loads(line) for line in (workdir / "ckpt" / "nightly" / "alerts.jsonl").read_text().splitlines()]
    assert logged == [alert_events[0].payload]

    expected_dir = Path(full["ppo"]["save_path"])
    expected_files = sorted(p.name for p in expected_dir.glob("*.safetensors"))
    assert expected_files and sorted(p.name for p in save_path.glob("*.safetensors")) == expected_files
    for name in expected_files:
        expected, actual = load_file(str(expected_dir / name)), load_file(str(save_path / name))
        assert expected.keys() == actual.keys()
        for tensor_name, tensor in expected.items():
            assert torch.equal(tensor, actual[tensor_name]), f"{name}:{tensor_name} differs from the unbudgeted run"


def test_the_quick_start_script_creates_the_automations(prefect_server, tmp_path):
    """deployments/local_worker.sh, the README's quick start, creates the automations that mark a killed worker's
    run Crashed (else such a run stays Running for ever), and says so, before it starts its worker."""
    from prefect.client.orchestration import SyncPrefectClient

    from deployments.create_automations import AUTOMATIONS_FILE, load_automations

    env = {**prefect_server.env, "RLHF_WORK_POOL": "rlhf-quickstart", "RLHF_SKIP_DEPLOY": "1"}
    script = BackgroundProcess.start("local-worker", [str(PROJECT_DIR / "deployments" / "local_worker.sh")], env,
                                     tmp_path / "local_worker.log")
    try:
        while "Worker" not in script.log_tail():  # `prefect worker start` comes after the automations
            assert script.alive(), script.log_tail()
            time.sleep(1)
        with SyncPrefectClient(prefect_server.api_url) as client:
            names = {automation.name for automation in client.read_automations()}
    finally:
        script.stop(grace=5)
    assert {automation.name for automation in load_automations(AUTOMATIONS_FILE)} <= names, names
    assert "a crashed run is restarted by itself" in script.log_tail()
    assert "rlhf-crash-unresponsive-flow-runs" in script.log_tail()


def run_paused_inside_a_chunk(deployed: Deployed, tmp_path: Path) -> tuple[str, Path]:
    """Start `rlhf/sft` with the rank pausing 10 s before step 12 (inside the chunk to step 16), and return once it
    is there and step 8 has committed: the flow run's id and the stage's checkpoint folder. The pause is the window
    in which the test's signal must arrive for step 12 to be the step in progress: a Cancel goes through the CLI,
    the server and the worker's poll, which took over 4 s on a loaded machine (step 13 committed instead); 10 s
    still leaves the step and its emergency commit inside --stop_grace_s 25 (less its fifth)."""
    from prefect.client.orchestration import SyncPrefectClient

    faults = tmp_path / "faults"
    faults.mkdir()
    with SyncPrefectClient(deployed.server.api_url) as client:
        env = dict(client.read_deployment_by_name("rlhf/sft").job_variables["env"])
    env.update(RLHF_FAULT_INJECT="train_step@12=sleep:10", RLHF_FAULT_STATE=str(faults))
    config = run_config(tmp_path, deployed.toy)
    started = deployed.server.cli("deployment", "run", "rlhf/sft", "--param", f"config={json.dumps(config)}",
                                  "--job-variable", f"env={json.dumps(env)}")
    flow_run_id = UUID.search(started.stdout).group(1)
    stage_dir = tmp_path / "ckpt" / config["run_name"] / "sft"
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ((faults / "train_step@12").exists() and (stage_dir / "step_8" / "MANIFEST.json").exists()):
        assert time.monotonic() < deadline, f"the run never reached step 12\n{deployed.worker.log_tail()}"
        time.sleep(0.2)
    return flow_run_id, stage_dir


def test_cancel_of_a_deployment_run_commits_the_step_in_progress(deployed, tmp_path):
    """Cancel in the UI (`prefect flow-run cancel`): the worker sends SIGTERM to the flow run's process group,
    the step in progress commits as an emergency checkpoint, and the run ends Cancelled with the stop's line.
    Before, the stopped run hung in `remove_placement_group` (the group's SIGTERM had killed Ray's GCS) until
    the grace period's watchdog ended it."""
    flow_run_id, stage_dir = run_paused_inside_a_chunk(deployed, tmp_path)
    deployed.server.cli("flow-run", "cancel", flow_run_id)
    flow_run = deployed.wait(flow_run_id)
    committed = sorted(int(p.parent.name.split("_")[1]) for p in stage_dir.glob("step_*/MANIFEST.json"))
    assert flow_run.state.type.value == "CANCELLED", f"{flow_run.state}\n{deployed.worker.log_tail()}"
    assert flow_run.state.message == (f"stopped by SIGTERM at step 12; committed step_12 in {stage_dir}; run the same "
                                      "command to continue"), deployed.worker.log_tail()
    assert committed == [8, 12]  # 12 is off the chunk boundaries (8, 16): the emergency commit


def test_a_preempted_deployment_run_commits_its_step_and_continues_by_itself(deployed, tmp_path):
    """SIGTERM to the flow run's process with no Cancel asked for in Prefect (a spot preemption, a node drain):
    the step in progress commits as an emergency checkpoint, the run is rescheduled in a state named Preempted, and
    the worker picks it up again: it resumes from that step and completes, with no call from the test. The Cancel
    above sends the same signal and stays a stop."""
    from prefect.client.orchestration import SyncPrefectClient

    flow_run_id, _ = run_paused_inside_a_chunk(deployed, tmp_path)
    process = flow_run_process(deployed.worker.pid, flow_run_id)
    assert process is not None, deployed.worker.log_tail()
    process.terminate()  # SIGTERM, as a preemption sends it: no state change asked of Prefect
    flow_run = deployed.wait(flow_run_id)
    assert flow_run.state.type.value == "COMPLETED", f"{flow_run.state}\n{deployed.worker.log_tail()}"
    with SyncPrefectClient(deployed.server.api_url) as client:
        states = client.read_flow_run_states(flow_run_id)
    names = [state.name for state in states]
    assert "Preempted" in names and names[-1] == "Completed", names
    preempted = next(state for state in states if state.name == "Preempted")
    assert "stopped by SIGTERM at step 12; committed step_12" in preempted.message, preempted.message
    assert flow_run.run_count == 2, flow_run.run_count


def test_a_killed_flow_run_process_starts_again_on_its_host(deployed, tmp_path):
    """SIGKILL to the flow run's engine process (the OOM killer's choice: the supervisor is small): its supervisor
    (flows/supervise.py) marks the run restarting and starts the engine again on this host, and the run resumes
    from its step-8 commit and completes. No Crashed state, no automation (this module creates none: without the
    supervisor the run would end Crashed here), and the same flow run on its second attempt."""
    from prefect.client.orchestration import SyncPrefectClient

    from flows.restarts import RESTART_MARK

    flow_run_id, stage_dir = run_paused_inside_a_chunk(deployed, tmp_path)
    engine = engine_process(deployed.worker.pid, flow_run_id)
    supervisor = flow_run_process(deployed.worker.pid, flow_run_id)
    assert engine is not None and supervisor is not None and engine.pid != supervisor.pid, deployed.worker.log_tail()
    engine.kill()
    flow_run = deployed.wait(flow_run_id)
    assert flow_run.state.type.value == "COMPLETED", f"{flow_run.state}\n{deployed.worker.log_tail()}"
    with SyncPrefectClient(deployed.server.api_url) as client:
        states = client.read_flow_run_states(flow_run_id)
    assert "CRASHED" not in [state.type.value for state in states], [state.name for state in states]
    restarts = [state for state in states if (state.message or "").startswith(RESTART_MARK)]
    assert len(restarts) == 1 and f"process {engine.pid} died by SIGKILL" in restarts[0].message, restarts
    assert flow_run.run_count == 2, flow_run.run_count
    committed = sorted(int(p.parent.name.split("_")[1]) for p in stage_dir.glob("step_*/MANIFEST.json"))
    assert 12 not in committed, committed  # no emergency commit: it died, and resumed from step 8
