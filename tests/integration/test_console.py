"""The console of `rlhf train sft` on the toy model: the chunk lines, not the Ray actors' prefixed output,
DeepSpeed's accelerator warning, transformers' load bars or Prefect's temporary-server lines; those go to
the run's log file ({ckpt_path}/{run_name}/logs/driver.log), and --verbose brings them back to the console.

The quiet run is also the test of `--time_budget_minutes`: a budget of 1e-6 minutes is spent by the end of
the first chunk (a flow run always trains one), so the run stops cleanly at that chunk boundary, whatever
the machine's speed; the same command without the budget then continues and finishes with the weights of
an uninterrupted run (`reference_sft_weights`).

Real processes: the CLI, Prefect's ephemeral server, a local Ray cluster and DeepSpeed (rlhf_core.console).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow

NOISE = ("(TrainWorker pid=", "Setting accelerator to CPU", "Loading weights", "temporary server")


def test_train_console_is_quiet_the_log_file_has_everything_and_a_time_budget_stops_at_a_chunk(
        toy_assets, rlhf_env, tmp_path, reference_sft_weights):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = train_sft_args(toy_assets, ckpt, out)
    log_file = ckpt / "rlhf" / "logs" / "driver.log"

    budgeted = run_rlhf([*args, "--time_budget_minutes", "1e-6"], rlhf_env)
    assert budgeted.returncode == 0, budgeted.stderr[-3000:]  # the flow run Completed
    console = budgeted.stdout + budgeted.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console}"
    stopped = "sft: stopped at step 5/32 because the time budget (time_budget_minutes) is spent"
    assert stopped in console, console
    assert [(info.step, info.status) for info in CheckpointStore(str(ckpt / "rlhf" / "sft")).list()] == \
        [(5, "committed")]
    assert not out.exists(), "a stage stopped by its budget was exported"
    assert "Finished in state Completed()" in log_file.read_text()

    result = run_rlhf(args, rlhf_env)  # no budget: continues from step 5 and finishes
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console}"
    assert "step 5/32: cached" in console and "step 32/32: trained" in console, console  # a line per chunk
    assert len(console.splitlines()) <= 20, console
    final = load_file(str(out / "model.safetensors"))
    assert final.keys() == reference_sft_weights.keys()
    for name, tensor in reference_sft_weights.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
    assert str(log_file) in console, "the console says where the full log is"
    written = log_file.read_text()
    for line in NOISE:
        assert line in written, f"{line!r} not in {log_file}"
    assert "step 32/32" in written


def test_verbose_brings_the_workers_output_back(toy_assets, rlhf_env, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*train_sft_args(toy_assets, ckpt, tmp_path / "out"), "--max_samples", "16", "--verbose"]
    result = run_rlhf(args, rlhf_env)
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for line in ("(TrainWorker pid=", "Loading weights", "temporary server"):
        assert line in console, f"{line!r} missing from the verbose console:\n{console}"
    assert "(TrainWorker pid=" in (ckpt / "rlhf" / "logs" / "driver.log").read_text()
