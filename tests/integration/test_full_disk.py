"""A full disk is one clear stop with nothing lost: `rlhf train sft` with --ckpt_path on a small tmpfs that holds
two checkpoints. The third chunk's checkpoint will not fit: the run stops at that boundary with exit 2 and one
sentence (path, free and needed bytes, remedies), no traceback and no Prefect retry; both commits verify, and
once the disk grows the same command finishes with the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import run_rlhf
from tests.integration.conftest import train_sft_args

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (needs root)")]

TWO_CHECKPOINTS = "3600k"  # the toy SFT checkpoint is ~1.4 MB; logs, lease and ledger share the disk


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TWO_CHECKPOINTS}", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def short_sft_args(toy_assets, ckpt: Path, out: Path) -> list[str]:
    """The README's SFT command cut to 6 steps of 8 samples, a checkpoint every 2."""
    args = train_sft_args(toy_assets, ckpt, out)
    args[args.index("--save_steps") + 1] = "2"
    args[args.index("--max_ckpt_num") + 1] = "0"  # keep every checkpoint: the disk, not retention, is the limit
    return [*args, "--max_samples", "48"]


def test_a_full_disk_stops_the_run_cleanly_and_the_same_command_resumes(small_disk, tmp_path, toy_assets, rlhf_env):
    ckpt, out = small_disk / "ckpt", tmp_path / "out"
    args = short_sft_args(toy_assets, ckpt, out)
    full = run_rlhf(args, rlhf_env, timeout=600)
    output = full.stdout + full.stderr
    assert full.returncode == 2, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1, output[-4000:]
    assert f"--ckpt_path {ckpt}/rlhf/sft: the checkpoint will not fit (" in errors[0]
    assert " MB free, the checkpoint needs " in errors[0] and "--max_ckpt_num" in errors[0], errors[0]
    assert "AwaitingRetry" not in output and "Retrying" not in output, "a full disk was retried"
    store = CheckpointStore(str(ckpt / "rlhf" / "sft"))
    assert [(info.step, info.status) for info in store.list(verify=True)] == [(2, "committed"), (4, "committed")]
    assert not [name for name in os.listdir(store.root) if name.startswith(".tmp_")], "staging left on the disk"

    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)
    resumed = run_rlhf(args, rlhf_env, timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    reference = run_rlhf(short_sft_args(toy_assets, tmp_path / "reference-ckpt", tmp_path / "reference"), rlhf_env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    weights, expected = (load_file(str(folder / "model.safetensors")) for folder in (out, tmp_path / "reference"))
    assert weights.keys() == expected.keys()
    assert all(weights[name].equal(expected[name]) for name in weights)


def test_a_disk_that_fills_during_a_write_names_the_store_and_keeps_the_commits(tmp_path):
    """Someone else fills the disk mid-write (no prediction can see it): ENOSPC becomes the same one sentence,
    the uncommitted staging is removed, the committed step still verifies."""
    from rlhf_core.errors import StoreFull

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        store = CheckpointStore(str(disk / "run" / "sft"))
        small, large = tmp_path / "small", tmp_path / "large"
        small.mkdir(), large.mkdir()
        (small / "weights.bin").write_bytes(b"s" * 500_000)
        (large / "weights.bin").write_bytes(b"l" * 3_000_000)
        store.commit(1, str(small), {"global_step": 1})
        with pytest.raises(StoreFull, match=rf"^--ckpt_path {disk}/run/sft: the disk is full; nothing was committed"):
            store.commit(2, str(large), {"global_step": 2})
        assert [(info.step, info.status) for info in store.list(verify=True)] == [(1, "committed")]
        assert sorted(os.listdir(store.root)) == ["latest", "step_1"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_under_the_log_folder_costs_one_warning_and_nothing_else(tmp_path, toy_assets, rlhf_env):
    """The run folder's logs/ (the driver's log file) on a disk with no room left: the run trains and commits
    as usual, exit 0, and the console gets one warning instead of a traceback per log record."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    logs = ckpt / "rlhf" / "logs"
    logs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(logs)], check=True)
    try:
        filler = os.open(logs / "filler", os.O_WRONLY | os.O_CREAT)  # someone else's file takes the whole disk
        try:
            while os.write(filler, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(filler)
        run = run_rlhf(short_sft_args(toy_assets, ckpt, out), rlhf_env, timeout=600)
    finally:
        subprocess.run(["umount", "-l", str(logs)], check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    warnings = [line for line in output.splitlines() if "cannot write the run's log file" in line]
    assert len(warnings) == 1 and str(logs / "driver.log") in warnings[0], output[-4000:]
    store = CheckpointStore(str(ckpt / "rlhf" / "sft"))
    assert [(info.step, info.status) for info in store.list(verify=True)] == [(2, "committed"), (4, "committed"),
                                                                             (6, "committed")]
    assert (out / "model.safetensors").is_file()
