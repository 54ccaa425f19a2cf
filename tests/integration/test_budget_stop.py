"""`--max_chunks_per_run`: the last chunk a run's chunk budget allows commits without training the next chunk
ahead (its steps would be thrown away when the run stops at that boundary).

Real processes: the CLI, a Prefect server, a Ray head (one per pytest process) and DeepSpeed. The test fault hook
`train_step@N=sleep:0` with RLHF_FAULT_STATE touches a marker file when a rank is about to train step N.
"""

from __future__ import annotations

import pytest

from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow


def test_the_last_chunk_of_a_chunk_budget_does_not_train_ahead(toy_assets, rlhf_env, tmp_path):
    ckpt, faults = tmp_path / "ckpt", tmp_path / "faults"
    faults.mkdir()
    env = {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@5=sleep:0,train_step@6=sleep:0",
           "RLHF_FAULT_STATE": str(faults)}
    done = run_rlhf([*train_sft_args(toy_assets, ckpt, tmp_path / "out"), "--max_chunks_per_run", "1"], env)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    assert "sft: stopped at step 5/32 because the chunk budget (max_chunks_per_run) is spent" in console, console
    assert [(info.step, info.status) for info in CheckpointStore(str(ckpt / "rlhf" / "sft")).list()] == \
        [(5, "committed")]
    assert (faults / "train_step@5").exists(), "the hook fires on this machine"
    assert not (faults / "train_step@6").exists(), "a rank trained past the chunk the budget allows"
