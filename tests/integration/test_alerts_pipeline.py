"""The non-finite alert end to end: a NaN injected into SFT's loss fails the chunk before its commit.

`RLHF_FAULT_INJECT="loss@8=nan"` multiplies step 8's loss by NaN (rlhf_core/faults.py). The chunk to
step 10 must fail without a Prefect retry, commit nothing at step 10, keep step 5 intact, and leave one
`rlhf.alert.non-finite` line in the run's alerts.jsonl that `rlhf ckpt ls` / `rlhf status` show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.alerts import ALERT_NON_FINITE, AlertLog
from rlhf_core.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow


def test_nan_in_the_loss_fails_the_chunk_uncommitted_unretried_and_alerts(toy_assets, rlhf_env, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    failed = run_rlhf(train_sft_args(toy_assets, ckpt, out), {**rlhf_env, "RLHF_FAULT_INJECT": "loss@8=nan"})
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
