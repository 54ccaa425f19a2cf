"""The automations of deployments/ on a real server: the alerts notify, and a SIGKILLed worker's run is retried.

`test_alert_events_fire_their_automations`: deployments/create_automations.py (after two
`prefect automation create -f` calls that leave duplicates) leaves exactly one automation per name, and
with `--notify-block` each `rlhf.alert.*` event reaches a webhook on loopback through a notification
block, with the run, stage and step in its subject. No Ray, a few seconds.

`test_a_killed_run_comes_back_by_itself_and_completes`: a deployment's run killed twice mid-chunk completes
with no call from the test (it only starts the run, and a second worker as a supervisor would).

Real processes: a Prefect server, the automations of deployments/automations.yaml (created by
deployments/create_automations.py), `rlhf/sft` deployed from this repository's prefect.yaml, a process
worker, a local Ray cluster and DeepSpeed. The toy SFT run has 3 chunks of 2 steps. A fault hook in the
first worker's environment pauses the rank before step 3 and again before step 5, each once its chunk before has
committed. At the first pause the test SIGKILLs the flow-run process (and the Ray cluster it started): the worker
sees its child die and marks the run Crashed, the automation rlhf-restart-crashed-runs reschedules it, and the
same worker runs it again from step 2. At the second pause the test SIGKILLs the worker with everything it
started, as a lost machine would: nobody reports that death, the heartbeat automation marks the run Crashed
after its window, the restart automation reschedules it, and a new worker (started by the test as systemd
would) finishes it: chunk 1 is Cached, the exported weights equal those of an uninterrupted `rlhf train sft`
with the same settings tensor for tensor, and the checkpoint committed before the kills is still committed,
byte for byte.

Prints the two times an operator cares about: each kill -> training again (or Completed).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import run_rlhf
from tests.integration.conftest import PAUSE_IS_NO_HANG_S, PREFECT, PROJECT_DIR, _descendants, _processes
from flows.restarts import RESTART_MARK
from tests.integration.test_deployment import (
    UUID,
    deployment_spec,
    flow_run_process,
)

pytestmark = pytest.mark.slow

PREFECT_FILE = PROJECT_DIR / "prefect.yaml"
AUTOMATIONS_FILE = PROJECT_DIR / "deployments" / "automations.yaml"
CREATE_AUTOMATIONS = PROJECT_DIR / "deployments" / "create_automations.py"
CRASH_AUTOMATION = "rlhf-crash-unresponsive-flow-runs"
HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
RUN_TIMEOUT = 420.0  # a cold first DeepSpeed start JIT-builds an op (~80 s); a warm run takes ~40 s
PAUSED_STEPS = (3, 5)  # inside chunk 2 (steps 3-4) and chunk 3 (steps 5-6), each once its chunk before committed
SETTINGS = {  # 48 samples / 8 per step = 6 steps, 3 chunks of 2; max_ckpt_num keeps all 3
    "max_len": 64, "max_samples": 48, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 1,
    "learning_rate": 1e-3, "save_steps": 2,
}


def run_config(tmp_path: Path, toy: dict[str, str]) -> dict:
    return {
        "run_name": "crash-retry", "stages": ["sft"], "ckpt_path": str(tmp_path / "ckpt"), "load_checkpoint": True,
        "max_ckpt_num": 3, "seed": 42, "num_workers": 1, "hang_timeout_s": PAUSE_IS_NO_HANG_S,
        "sft": {"pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
                "save_path": str(tmp_path / "out" / "sft"), **SETTINGS},
    }


def reference_weights(tmp_path: Path, toy: dict[str, str], env: dict[str, str]) -> dict[str, torch.Tensor]:
    """The same SFT run through `rlhf train sft`, never interrupted."""
    out = tmp_path / "reference"
    args = ["train", "sft", "--pretrain", toy["model"], "--dataset", toy["sft"], "--input_key", "prompt",
            "--output_key", "response", "--ckpt_path", str(out / "ckpt"), "--max_ckpt_num", "3",
            "--save_path", str(out / "model"), "--seed", "42"]
    for flag, value in SETTINGS.items():
        args += [f"--{flag}", str(value)]
    result = run_rlhf(args, env)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(str(out / "model" / "model.safetensors"))


def paused_in_chunk(fault_state: Path, stage_dir: Path, step: int, worker) -> None:
    """Wait until the rank has paused before `step` (the fault hook's marker) and the chunk before it committed
    (it commits in the background while the next one trains)."""
    wait_until(f"the rank paused before step {step}", lambda: (fault_state / f"train_step@{step}").exists(),
               RUN_TIMEOUT, context=worker.log_tail)
    wait_until(f"step {step - 1} committed", lambda: (stage_dir / f"step_{step - 1}" / "MANIFEST.json").exists(),
               RUN_TIMEOUT, context=worker.log_tail)


def ended_for_good(api_url: str, flow_run_id: str):
    """The flow run once it is in a final state that nothing restarts (a plain Crashed is restarted), else None."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        flow_run = client.read_flow_run(flow_run_id)
    state = flow_run.state
    if state is None or not state.is_final() or (state.type.value == "CRASHED" and state.name == "Crashed"):
        return None
    return flow_run


def crash_window_s() -> float:
    spec = yaml.safe_load(AUTOMATIONS_FILE.read_text())
    automation = next(a for a in spec["automations"] if a["name"] == CRASH_AUTOMATION)
    return float(automation["trigger"]["within"])


def create_automations(prefect_server) -> dict[str, str]:
    """Run the one command; returns {name: id} as the server lists them."""
    from prefect.client.orchestration import SyncPrefectClient

    result = subprocess.run([sys.executable, str(CREATE_AUTOMATIONS), "--api-url", prefect_server.api_url],
                            env=prefect_server.env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    with SyncPrefectClient(prefect_server.api_url) as client:
        return {automation.name: str(automation.id) for automation in client.read_automations()}


def committed_manifests(stage_dir: Path) -> dict[str, bytes]:
    return {path.parent.name: path.read_bytes() for path in stage_dir.glob("step_*/MANIFEST.json")}


def sigkill_tree(root_pid: int) -> list[int]:
    """SIGKILL `root_pid` and every process in the sessions of its process tree (the worker runs each flow
    run in a session of its own, and the Ray cluster that run started lives there), at once: no process gets
    a chance to report anything. Returns the pids killed."""
    table = _processes()
    sessions = {root_pid} | {table[pid][2] for pid in _descendants(root_pid, table)}
    killed: set[int] = set()
    for _ in range(50):
        left = [pid for pid, (_, _, sid) in _processes().items() if sid in sessions or pid == root_pid]
        if not left:
            return sorted(killed)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    raise AssertionError(f"processes of sessions {sorted(sessions)} survived SIGKILL")


def wait_until(what: str, condition, timeout: float, interval: float = 1.0, context=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{context()}"
        time.sleep(interval)
    return value


def chunk_task_states(api_url: str, flow_run_id: str) -> dict[str, list[str]]:
    """Task run name -> state names of every `train_chunk` run of the flow run and its subflow runs."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

    states: dict[str, list[str]] = {}
    with SyncPrefectClient(api_url) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [flow_run_id]}))
        run_ids = [flow_run_id, *(str(child.id) for child in children)]
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": run_ids}),
                                          task_run_filter=TaskRunFilter(name={"like_": "sft-to-step-"}))
    for task_run in task_runs:
        states.setdefault(task_run.name, []).append(task_run.state.name if task_run.state else "None")
    return states


def flow_run_state(api_url: str, flow_run_id: str):
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        return client.read_flow_run(flow_run_id).state


ALERT_EVENTS = ("rlhf.alert.reward-stagnant", "rlhf.alert.checkpoint-size", "rlhf.alert.non-finite")


class _Webhook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self):
        _Webhook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def emit_alert(api_url: str, name: str, step: int) -> None:
    """What flows/pipeline.py emits for an alert: resource rlhf.run.{run}.{stage}, the alert as payload."""
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient

    alert = {"name": name, "run_name": "alerts-demo", "stage": "sft", "step": step, "message": f"{name} fired",
             "details": {}, "time": time.time()}

    async def send():
        async with PrefectEventsClient(api_url) as events:
            await events.emit(Event(event=name, resource={"prefect.resource.id": "rlhf.run.alerts-demo.sft"},
                                    payload=alert))

    asyncio.run(send())


def test_alert_events_fire_their_automations(prefect_server):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for _ in range(2):  # Prefect's own command adds copies; ours must reduce them to one per name
        prefect_server.cli("automation", "create", "--from-file", str(AUTOMATIONS_FILE))
    names = [a["name"] for a in yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"]]
    assert sorted(create_automations(prefect_server)) == sorted(names)

    _Webhook.received = []
    webhook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            CustomWebhookNotificationBlock(
                name="rlhf-alerts", url=f"http://127.0.0.1:{webhook.server_address[1]}/hook",
                json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("rlhf-test-alerts", overwrite=True)
        result = subprocess.run([sys.executable, str(CREATE_AUTOMATIONS), "--api-url", prefect_server.api_url,
                                 "--notify-block", "custom-webhook/rlhf-test-alerts"],
                                env=prefect_server.env, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        with SyncPrefectClient(prefect_server.api_url) as client:
            assert sorted(a.name for a in client.read_automations()) == sorted(names)
        for step, name in enumerate(ALERT_EVENTS, start=1):
            emit_alert(prefect_server.api_url, name, step)
        wait_until("a notification per alert", lambda: len(_Webhook.received) >= len(ALERT_EVENTS), 120,
                   context=lambda: f"received {_Webhook.received}\n{prefect_server.process.log_tail()}")
    finally:
        webhook.shutdown()
    by_alert = {message["subject"].split(":")[0].removeprefix("RLHF alert "): message for message in _Webhook.received}
    assert sorted(by_alert) == sorted(ALERT_EVENTS), _Webhook.received
    for step, name in enumerate(ALERT_EVENTS, start=1):
        assert by_alert[name]["subject"] == f"RLHF alert {name}: run alerts-demo, stage sft, step {step}"
        assert f"{name} fired" in by_alert[name]["body"], by_alert[name]


def test_a_killed_run_comes_back_by_itself_and_completes(prefect_server, background, toy_assets, rlhf_env, tmp_path):
    """Slow (200-400 s) because it waits for Prefect itself: the crash automation's heartbeat window is 90 s,
    Prefect's minimum, and the run needs a server, a process worker, two kills and a second worker."""
    from prefect.client.orchestration import SyncPrefectClient

    from rlhf_core.storage.checkpoint import CheckpointStore

    # The automations, by the one command; a second call updates them in place.
    automations = create_automations(prefect_server)
    assert create_automations(prefect_server) == automations
    assert CRASH_AUTOMATION in automations and len(automations) == 7  # crash, restart, and an alert's each

    spec = deployment_spec("sft")
    pool = spec["work_pool"]["name"]
    prefect_server.cli("work-pool", "create", pool, "--type", "process")
    prefect_server.cli("--no-prompt", "deploy", "--name", "sft", "--prefect-file", str(PREFECT_FILE), cwd=PROJECT_DIR, env={"PWD": str(PROJECT_DIR)})
    with SyncPrefectClient(prefect_server.api_url) as client:
        job_env = client.read_deployment_by_name("rlhf/sft").job_variables["env"]
    heartbeat_s = float(job_env.get(HEARTBEAT_SETTING, 0))
    assert 30 <= heartbeat_s <= crash_window_s() / 3, (
        f"prefect.yaml must set {HEARTBEAT_SETTING} (30 s or more, at most a third of the "
        f"{crash_window_s():.0f} s window of {CRASH_AUTOMATION}) in the deployment's job env; it has {job_env}")

    fault_state = tmp_path / "faults"
    fault_state.mkdir()
    pauses = ",".join(f"train_step@{step}=sleep:900" for step in PAUSED_STEPS)
    worker_env = {**prefect_server.env, "PREFECT_WORKER_QUERY_SECONDS": "2",
                  "RLHF_FAULT_INJECT": pauses, "RLHF_FAULT_STATE": str(fault_state)}
    worker = background("worker-1", [PREFECT, "worker", "start", "--pool", pool], worker_env, cwd=tmp_path)

    config = run_config(tmp_path, toy_assets)
    started = prefect_server.cli("deployment", "run", "rlhf/sft", "--param", f"config={json.dumps(config)}")
    flow_run_id = UUID.search(started.stdout).group(1)
    stage_dir = tmp_path / "ckpt" / config["run_name"] / "sft"

    # 1. The flow-run process dies (SIGKILL, as the OOM killer sends it) inside chunk 2; its worker lives.
    paused_in_chunk(fault_state, stage_dir, PAUSED_STEPS[0], worker)
    before_kill = committed_manifests(stage_dir)
    assert sorted(before_kill) == ["step_2"], sorted(before_kill)
    process = flow_run_process(worker.pid, flow_run_id)
    assert process is not None, worker.log_tail()
    sigkill_tree(process.pid)  # the flow-run process and the Ray cluster it started, in its session
    killed_at = time.monotonic()
    paused_in_chunk(fault_state, stage_dir, PAUSED_STEPS[1], worker)  # restarted by itself, into chunk 3
    print(f"\nflow-run process SIGKILLed -> the restarted run trains chunk 3: {time.monotonic() - killed_at:.0f} s")

    # 2. The worker dies with it (a lost machine): nobody reports the death; the heartbeat automation does.
    killed = sigkill_tree(worker.pid)
    killed_at = time.monotonic()
    print(f"SIGKILLed the worker and {len(killed) - 1} processes it started")
    # A supervisor (systemd, Kubernetes) starts the worker again, without the fault hook; nothing else happens.
    retry_env = {k: v for k, v in worker_env.items() if not k.startswith("RLHF_FAULT")}
    new_worker = background("worker-2", [PREFECT, "worker", "start", "--pool", pool], retry_env, cwd=tmp_path)
    flow_run = wait_until("the run completed or ended for good", lambda: ended_for_good(prefect_server.api_url,
                                                                                       flow_run_id),
                          crash_window_s() + 2 * heartbeat_s + RUN_TIMEOUT, interval=2, context=new_worker.log_tail)
    print(f"worker SIGKILLed -> {flow_run.state.name}: {time.monotonic() - killed_at:.0f} s (automation window "
          f"{crash_window_s():.0f} s, heartbeat {heartbeat_s:.0f} s)")
    assert flow_run.state.type.value == "COMPLETED", (
        f"the run ended {flow_run.state.name}: {flow_run.state.message}\n{new_worker.log_tail()}")
    with SyncPrefectClient(prefect_server.api_url) as client:
        states = client.read_flow_run_states(flow_run_id)
    restarts = [state for state in states if (state.message or "").startswith(RESTART_MARK)]
    assert len(restarts) == 2 and [state.name for state in states].count("Crashed") == 2, \
        [(state.name, state.message) for state in states]

    chunks = chunk_task_states(prefect_server.api_url, flow_run_id)
    assert "Cached" in chunks.get("sft-to-step-2", []), f"chunk 1 not Cached on the retry: {chunks}"
    for target in ("sft-to-step-4", "sft-to-step-6"):
        assert "Completed" in chunks.get(target, []), f"{target} not trained on the retry: {chunks}"

    after = committed_manifests(stage_dir)
    assert {name: after.get(name) for name in before_kill} == before_kill, "a checkpoint committed before the kill changed"
    listed = {info.name: info.is_committed for info in CheckpointStore(str(stage_dir)).list(verify=True)}
    assert listed == {"step_2": True, "step_4": True, "step_6": True}, listed

    weights = load_file(str(Path(config["sft"]["save_path"]) / "model.safetensors"))
    reference = reference_weights(tmp_path, toy_assets, rlhf_env)
    assert weights.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(weights[name], reference[name])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run's, e.g. {different[:3]}"
