"""Alerts end to end.

The non-finite alert: a NaN loss fails the chunk before its commit. `RLHF_FAULT_INJECT="train_step@8=nan"`
makes the rank's weights NaN as it enters step 8 (`rlhf_core.rank.worker.poison_weights`), so step 8's loss is
non-finite, as a diverged run's, with no hook inside the loss. The chunk to
step 10 must fail without a Prefect retry, commit nothing at step 10, keep step 5 intact, and leave one
`rlhf.alert.non-finite` line in the run's alerts.jsonl that `rlhf ckpt ls` / `rlhf status` show.

The reward-stagnant alert reaching the person watching `rlhf train ppo` (issue 17): a reward function in
OpenRLHF's form given to `--reward_fn` (it is called in its own form), whose reward never changes. Each chunk
prints one warning that its rollout batches teach nothing, and the second commit's stagnant alert
(`--alert_reward_window 1`) is one `rlhf: warning:` line on the console and in the flow run's log.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from rlhf_core.ops.alerts import ALERT_NON_FINITE, ALERT_REWARD_STAGNANT, AlertLog
from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import on_local_ray, train_sft_args

pytestmark = pytest.mark.slow


def test_nan_in_the_loss_fails_the_chunk_uncommitted_unretried_and_alerts(toy_assets, rlhf_env, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    failed = run_rlhf(train_sft_args(toy_assets, ckpt, out), {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@8=nan"})
    assert failed.returncode != 0
    console = failed.stdout + failed.stderr
    assert "step 5/32: trained 5 steps" in console, console[-3000:]

    store = CheckpointStore(str(ckpt / "rlhf" / "sft"))
    assert [(info.step, info.status) for info in store.list(verify=True)] == [(5, "committed")]
    assert not out.exists()
    driver_log = (ckpt / "rlhf" / "logs" / "driver.log").read_text()
    assert "Retry" not in driver_log.split("sft-to-step-10", 1)[-1], "a non-finite chunk must not be retried"

    alerts = AlertLog(str(ckpt / "rlhf")).read()
    assert [(alert.name, alert.stage, alert.step) for alert in alerts] == [(ALERT_NON_FINITE, "sft", 10)]
    assert "loss" in alerts[0].message
    listing = run_rlhf(["ckpt", "ls", str(ckpt / "rlhf" / "sft")], rlhf_env)
    assert ALERT_NON_FINITE in listing.stdout, listing.stdout
    status = run_rlhf(["status", str(ckpt / "rlhf")], rlhf_env)
    assert status.returncode == 0 and ALERT_NON_FINITE in status.stdout, status.stdout + status.stderr


CONSTANT_REWARD_FUNC = """
import json, os


def reward_func(queries, prompts, labels, **kwargs):
    with open(os.environ["REWARD_CALLS"], "a") as calls:
        calls.write(json.dumps([queries[0], prompts[0], labels[0]]) + "\\n")
    return [0.5] * len(queries)
"""


def test_a_flat_ppo_reward_warns_per_chunk_and_its_stagnant_alert_reaches_the_console(toy_assets, rlhf_env,
                                                                                       tmp_path):
    (tmp_path / "flat_reward.py").write_text(CONSTANT_REWARD_FUNC)
    calls, ckpt = tmp_path / "calls.jsonl", tmp_path / "ckpt"
    run_name = f"flat-{uuid.uuid4().hex[:8]}"  # its flow runs' names, to find their logs in Prefect's database
    env = {**on_local_ray(rlhf_env),  # the ranks import flat_reward from PYTHONPATH
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), rlhf_env.get("PYTHONPATH")])),
           "REWARD_CALLS": str(calls)}
    ran = run_rlhf(["train", "ppo", "--run_name", run_name, "--pretrain", toy_assets["model"],
                    "--reward_fn", "flat_reward:reward_func",
                    "--prompt_data", toy_assets["prompts"], "--input_key", "prompt", "--max_samples", "16",
                    "--advantage_estimator", "reinforce", "--init_kl_coef", "0", "--rollout_batch_size", "4",
                    "--micro_rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "4",
                    "--max_new_tokens", "4", "--prompt_max_len", "32", "--save_steps", "2",
                    "--alert_reward_window", "1", "--ckpt_path", str(ckpt), "--save_path", str(tmp_path / "out")],
                   env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    console = (ran.stdout + ran.stderr).splitlines()
    query, prompt, label = json.loads(calls.read_text().splitlines()[0])
    assert query.startswith(prompt) and prompt.startswith("sort :") and label == "", (query, prompt, label)

    flat = [line for line in console if "every reward of the rollout batch is 0.5" in line]
    assert [line.split(":", 3)[2] for line in flat] == [" ppo step 1", " ppo step 3"], console  # once per chunk
    assert all(line.startswith("rlhf: warning: ppo step ") for line in flat), flat

    alerts = AlertLog(str(ckpt / run_name)).read()
    assert [(alert.name, alert.step) for alert in alerts] == [(ALERT_REWARD_STAGNANT, 4)]
    line = f"rlhf: warning: {alerts[0].message} ({ALERT_REWARD_STAGNANT})"
    assert console.count(line) == 1, console
    logged = flow_run_log(rlhf_env["PREFECT_API_URL"], run_name)
    assert logged.count(line) == 1, logged


def flow_run_log(api_url: str, run_name: str) -> list[str]:
    """What the flow runs named after `run_name` (the run and its stage subflows) logged, read from the server."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    with SyncPrefectClient(api_url) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_name)))
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id for flow_run in flow_runs]))
        messages: list[str] = []
        while True:  # the server answers 200 logs at most per request
            page = client.read_logs(log_filter=log_filter, limit=200, offset=len(messages))
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages
