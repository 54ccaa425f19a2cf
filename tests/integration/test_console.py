"""The console of `rlhf train sft` on the toy model: the chunk lines, not the Ray actors' prefixed output,
DeepSpeed's accelerator warning, transformers' load bars or Prefect's temporary-server lines; those go to
the run's log file ({ckpt_path}/{run_name}/logs/driver.log), and --verbose brings them back to the console.

Real processes: the CLI, Prefect's ephemeral server, a local Ray cluster and DeepSpeed (rlhf_core.console).
"""

from __future__ import annotations

import pytest

from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow

NOISE = ("(TrainWorker pid=", "Setting accelerator to CPU", "Loading weights", "temporary server")


def test_train_console_is_quiet_and_the_log_file_has_everything(toy_assets, rlhf_env, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_rlhf(train_sft_args(toy_assets, ckpt, tmp_path / "out"), rlhf_env)
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console}"
    assert "step 5/32" in console and "step 32/32" in console, console  # a line per chunk
    assert len(console.splitlines()) <= 20, console
    log_file = ckpt / "rlhf" / "logs" / "driver.log"
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
