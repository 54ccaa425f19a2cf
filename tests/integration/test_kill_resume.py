"""The kill test: SIGKILL `rlhf train sft` mid-run, run it again, and get the uninterrupted run's weights.

Real processes all the way: the CLI, Prefect's ephemeral server, a local Ray cluster and DeepSpeed.
A fault hook pauses the first run inside step 13 (after steps 5 and 10 are committed), so the kill
lands mid-chunk deterministically.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import RLHF, run_rlhf
from tests.integration.conftest import PAUSED_ON_PURPOSE, train_sft_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rlhf_env(ephemeral_rlhf_env) -> dict[str, str]:
    """The kill and resume as a user without PREFECT_API_URL runs them: on Prefect's ephemeral server."""
    return ephemeral_rlhf_env


def wait_for(path: Path, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended (rc {process.returncode}) before {path} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.2)


def kill_in_the_third_chunk(command: list[str], env: dict[str, str], ckpt: Path, output=subprocess.DEVNULL) -> None:
    """Run `command` (its output to `output`) and SIGKILL its whole session once step 10 of `ckpt`'s SFT has
    committed and the third chunk trains (where `train_step@13=sleep:600` holds it)."""
    killed = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(ckpt / "rlhf" / "sft" / "step_10" / "MANIFEST.json", killed, timeout=400)
        time.sleep(2)  # let the third chunk start training
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()


def test_sigkill_mid_chunk_then_rerun_matches_uninterrupted_run(toy_assets, rlhf_env, tmp_path,
                                                                 reference_sft_weights):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    paused_env = {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@13=sleep:600"}
    kill_in_the_third_chunk([RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE], paused_env, ckpt)
    committed_before = sorted(p.name for p in (ckpt / "rlhf" / "sft").glob("step_*"))
    assert committed_before == ["step_10", "step_5"]
    manifest_10 = (ckpt / "rlhf" / "sft" / "step_10" / "MANIFEST.json").read_bytes()
    assert not out.exists()

    resumed = run_rlhf(train_sft_args(toy_assets, ckpt, out), rlhf_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "step 5/32: cached" in log and "step 10/32: cached" in log, log[-3000:]
    assert "step 15/32: trained 5 steps" in log, log[-3000:]
    # The quiet console leaves Prefect's task-state lines to the run's log file.
    driver_log = (ckpt / "rlhf" / "logs" / "driver.log").read_text()
    assert driver_log.count("Finished in state Cached") >= 2, driver_log[-3000:]
    # Retention (max_ckpt_num 3) removed step_10 only after newer commits; nothing was rewritten.
    assert not (ckpt / "rlhf" / "sft" / "step_10").exists() or \
        (ckpt / "rlhf" / "sft" / "step_10" / "MANIFEST.json").read_bytes() == manifest_10

    actual = load_file(str(out / "model.safetensors"))
    assert reference_sft_weights.keys() == actual.keys()
    for name, tensor in reference_sft_weights.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"

    # The goodput ledger saw both attempts: the killed one as crashed, every step committed once.
    from rlhf_core.ops.goodput import GoodputLedger
    from rlhf_core.ops.goodput_summary import summarize

    ledger = summarize(GoodputLedger(str(ckpt / "rlhf")).read())
    assert ledger.num_attempts == 2 and ledger.num_crashed == 1, ledger
    assert (ledger.stages[0].steps, ledger.stages[0].chunks) == (32, 7), ledger
    assert ledger.stages[0].lost_steps in (0, 5), ledger  # 5 once chunk 15 had started before the kill
    assert 0 < ledger.total.goodput < 1, ledger
