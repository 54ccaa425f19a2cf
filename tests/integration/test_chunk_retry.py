"""Prefect retries a chunk whose Ray worker died, and the retried run still ends bit-for-bit exact.

Two DeepSpeed ranks (ZeRO-2 over gloo). A fault hook SIGKILLs one rank's process once, inside step 7
(the second chunk); the chunk task fails, Prefect retries it, the retry starts a new worker group from
the step-5 checkpoint, and the final weights equal those of an uninterrupted two-rank run.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow


def test_worker_killed_mid_chunk_is_retried_and_exact(toy_assets, rlhf_env, tmp_path):
    two_ranks = ["--num_workers", "2", "--max_epochs", "1"]
    reference = run_rlhf(train_sft_args(toy_assets, tmp_path / "ref", tmp_path / "ref-out") + two_ranks, rlhf_env)
    assert reference.returncode == 0, reference.stderr[-3000:]

    (tmp_path / "faults").mkdir()
    env = {**rlhf_env, "RLHF_FAULT_INJECT": "train_step@7=kill", "RLHF_FAULT_STATE": str(tmp_path / "faults")}
    faulty = run_rlhf(train_sft_args(toy_assets, tmp_path / "ckpt", tmp_path / "out") + two_ranks, env)
    log = faulty.stdout + faulty.stderr
    assert faulty.returncode == 0, log[-4000:]
    assert (tmp_path / "faults" / "train_step@7").exists(), "the fault never fired"
    assert "Retry 1/2 will start" in log, log[-4000:]

    expected = load_file(str(tmp_path / "ref-out" / "model.safetensors"))
    actual = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"

    listing = run_rlhf(["ckpt", "ls", str(tmp_path / "ckpt" / "rlhf" / "sft"), "--json", "--verify"], rlhf_env)
    entries = json.loads(listing.stdout)
    assert [entry["step"] for entry in entries] == [25, 30, 32]  # max_ckpt_num 3 kept the newest three
    assert all(entry["status"] == "committed" for entry in entries)
    metadata = json.loads((tmp_path / "ckpt" / "rlhf" / "sft" / "step_32" / "training_metadata.json").read_text())
    assert metadata["world_size"] == 2 and metadata["consumed_samples"] == 32 * 8
