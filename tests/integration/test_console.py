"""The console of `rlhf train sft` on the toy model, and `--time_budget_minutes`, in one run continued once.

Quiet (the default): the chunk lines, not the Ray actors' prefixed output, DeepSpeed's accelerator warning,
transformers' load bars or Prefect's temporary-server lines; those go to the run's log file
({ckpt_path}/{run_name}/logs/driver.log). `--verbose` brings them back to the console.

The quiet run carries a time budget of 1e-6 minutes: spent by the end of its first chunk (a flow run always
trains one), so it stops cleanly at that chunk boundary whatever the machine's speed: Completed, nothing
exported, the console saying why, and without training the next chunk ahead (the budget was spent before the
chunk began, so those steps would be thrown away). The same command with `--verbose` and no budget then
continues from there and finishes with the weights of an uninterrupted run (`reference_sft_weights`), tensor for tensor.
One run continued, rather than a quiet run and a separate verbose one: the suite pays for one more start.

Real processes: the CLI, Prefect's ephemeral server, a local Ray cluster and DeepSpeed (rlhf_core.ops.console).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rlhf_env(ephemeral_rlhf_env) -> dict[str, str]:
    """The console as a user without PREFECT_API_URL sees it: on Prefect's ephemeral server."""
    return ephemeral_rlhf_env

NOISE = ("(TrainWorker pid=", "Setting accelerator to CPU", "Loading weights", "temporary server")


def test_quiet_console_and_a_time_budget_stop_then_a_verbose_run_finishes_it(toy_assets, rlhf_env, tmp_path,
                                                                              reference_sft_weights):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = train_sft_args(toy_assets, ckpt, out)
    log_file = ckpt / "rlhf" / "logs" / "driver.log"

    faults = tmp_path / "faults"  # the test hook's marker files: which steps a rank was about to train
    faults.mkdir()
    budgeted = run_rlhf([*args, "--time_budget_minutes", "1e-6"],
                        {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@5=sleep:0,train_step@6=sleep:0",
                         "RLHF_FAULT_STATE": str(faults)})
    assert budgeted.returncode == 0, budgeted.stderr[-3000:]  # the flow run Completed
    console = budgeted.stdout + budgeted.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console}"
    assert "step 5/32: trained 5 steps" in console, console  # the chunk line
    assert "sft: stopped at step 5/32 because the time budget (time_budget_minutes) is spent" in console, console
    assert len(console.splitlines()) <= 15, console
    assert str(log_file) in console, "the console says where the full log is"
    written = log_file.read_text()
    for line in (*NOISE, "step 5/32", "Finished in state Completed()"):
        assert line in written, f"{line!r} not in {log_file}"
    assert [(info.step, info.status) for info in CheckpointStore(str(ckpt / "rlhf" / "sft")).list()] == \
        [(5, "committed")]
    assert not out.exists(), "a stage stopped by its budget was exported"
    assert (faults / "train_step@5").exists(), "the hook fires on this machine"
    assert not (faults / "train_step@6").exists(), "a rank trained ahead past a time budget already spent"

    verbose = run_rlhf([*args, "--verbose"], rlhf_env)  # no budget: continues from step 5 and finishes
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    console = verbose.stdout + verbose.stderr
    for line in ("(TrainWorker pid=", "Loading weights", "temporary server"):
        assert line in console, f"{line!r} missing from the verbose console:\n{console[-5000:]}"
    assert "step 5/32: cached" in console and "step 32/32: trained" in console, console[-5000:]
    final = load_file(str(out / "model.safetensors"))
    assert final.keys() == reference_sft_weights.keys()
    for name, tensor in reference_sft_weights.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
