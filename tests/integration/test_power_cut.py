"""Power cuts on a real filesystem: the harness (tests/powercut_fs.py, FUSE) drops what no fsync made durable.

First the harness's own rules, then the checkpoint store on it: with the store's fsyncs every committed step
verifies after a cut and `latest` names the newest; with fsync turned into a no-op (the store as it was before
it synced anything) the harness loses the commit, which is what makes the first result mean something.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rlhf_core.storage.checkpoint import CheckpointStore
from tests.powercut_fs import PowerCutMount

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                                reason="needs /dev/fuse and fusermount3 (apt-get install fuse3; .ci/run does)")


@pytest.fixture
def disk(tmp_path):
    with PowerCutMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "fs.log") as mount:
        yield mount


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_the_harness_keeps_only_what_was_made_durable(disk):
    top = disk.mountpoint
    fsync_path(top)  # nothing new yet
    (top / "unsynced.txt").write_text("gone")
    (top / "synced.txt").write_text("kept")
    fsync_path(top / "synced.txt")
    (top / "renamed_early.txt").write_text("x")
    fsync_path(top / "renamed_early.txt")
    fsync_path(top)  # names so far: unsynced.txt, synced.txt, renamed_early.txt
    os.rename(top / "renamed_early.txt", top / "renamed.txt")  # no fsync of the folder after it
    (top / "sub").mkdir()
    (top / "sub" / "late.txt").write_text("y")
    fsync_path(top / "sub" / "late.txt")  # its folder's entry was never synced
    disk.cut()
    names = sorted(os.listdir(top))
    assert names == ["renamed_early.txt", "synced.txt", "unsynced.txt"], names
    assert (top / "synced.txt").read_text() == "kept"
    assert (top / "unsynced.txt").read_text() == ""  # its name was durable, its bytes never were
    assert (top / "renamed_early.txt").read_text() == "x"  # the rename was not durable: the old name is back


def commit_steps(store: CheckpointStore, workdir: Path, steps: range) -> None:
    for step in steps:
        local = workdir / f"local_{step}"
        (local / "model").mkdir(parents=True)
        (local / "model" / "weights.bin").write_bytes(bytes([step]) * 100_000)
        (local / "config.json").write_text('{"step": %d}' % step)
        store.commit(step, str(local), {"global_step": step})
        store.retain(max_num=2)


def test_committed_checkpoints_survive_a_power_cut(disk, tmp_path):
    """Also when the run's folder was made before by someone else, unsynced (the lease, the log folder)."""
    (disk.mountpoint / "ckpt" / "run" / "logs").mkdir(parents=True)
    store_url = str(disk.mountpoint / "ckpt" / "run" / "sft")
    commit_steps(CheckpointStore(store_url), tmp_path, range(1, 4))
    disk.cut()
    infos = CheckpointStore(store_url).list(verify=True)
    assert [(info.step, info.status) for info in infos] == [(2, "committed"), (3, "committed")], infos
    assert CheckpointStore(store_url).latest_name() == "step_3"


def test_without_fsync_a_power_cut_loses_the_commit(disk, tmp_path, monkeypatch):
    """The store with every fsync a no-op, as before it synced anything: the harness catches it."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    store_url = str(disk.mountpoint / "ckpt" / "run" / "sft")
    commit_steps(CheckpointStore(store_url), tmp_path, range(1, 4))
    disk.cut()
    store = CheckpointStore(store_url)
    assert not [info for info in store.list(verify=True) if info.is_committed]
    assert store.latest_name() is None
