"""Power cuts on a real filesystem: the harness (tests/powercut_fs.py, FUSE) drops what no fsync made durable.

First the harness's own rules, then the checkpoint store on it: with the store's fsyncs every committed step
verifies after a cut and `latest` names the newest; with fsync turned into a no-op (the store as it was before
it synced anything) the harness loses the commit, which is what makes the first result mean something. With
torn writes (a cut keeps the first half of an un-fsync'd write), a step whose files tore is never listed as
committed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import MANIFEST_NAME
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


@pytest.mark.parametrize("torn_writes, appended_after_cut, new_after_cut",
                         [(False, b"synced|", b""), (True, b"synced|01234", b"abcd")])
def test_a_cut_drops_an_unsynced_write_or_with_torn_writes_keeps_its_first_half(tmp_path, torn_writes,
                                                                                appended_after_cut, new_after_cut):
    """Bytes written after a file's last fsync are gone at a cut, or with torn writes half there; an fsync'd file
    is whole and a name no folder fsync made durable is gone, in both modes."""
    with PowerCutMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "fs.log", torn_writes=torn_writes) as disk:
        top = disk.mountpoint
        (top / "appended.bin").write_bytes(b"synced|")
        fsync_path(top / "appended.bin")
        with open(top / "appended.bin", "ab") as stream:
            stream.write(b"0123456789")  # never fsync'd
        (top / "new.bin").write_bytes(b"abcdefgh")  # never fsync'd; its name is, below
        (top / "whole.bin").write_bytes(b"whole")
        fsync_path(top / "whole.bin")
        fsync_path(top)
        (top / "nameless.bin").write_bytes(b"no durable name")  # created after the folder's fsync
        disk.cut()
        assert sorted(os.listdir(top)) == ["appended.bin", "new.bin", "whole.bin"]
        assert (top / "appended.bin").read_bytes() == appended_after_cut
        assert (top / "new.bin").read_bytes() == new_after_cut
        assert (top / "whole.bin").read_bytes() == b"whole"


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


def test_with_torn_writes_a_step_whose_files_tore_is_never_listed_as_committed(tmp_path, monkeypatch):
    """A store that fsyncs its folders and manifests but not its checkpoint files (an fsync misplaced): a cut
    with torn writes leaves each step's manifest whole beside torn files, neither empty nor whole. The store
    lists none of those steps as committed, verified or not."""
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    checkpoint_files = {"weights.bin", "config.json", "training_metadata.json"}

    def skipping_checkpoint_files(sync):
        def maybe_sync(fd: int) -> None:
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) not in checkpoint_files:
                sync(fd)
        return maybe_sync

    monkeypatch.setattr(os, "fsync", skipping_checkpoint_files(real_fsync))
    monkeypatch.setattr(os, "fdatasync", skipping_checkpoint_files(real_fdatasync))
    with PowerCutMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "fs.log", torn_writes=True) as disk:
        store_url = str(disk.mountpoint / "ckpt" / "run" / "sft")
        commit_steps(CheckpointStore(store_url), tmp_path, range(1, 4))
        disk.cut()
        infos = CheckpointStore(store_url).list(verify=False)
        assert [info.step for info in infos] == [2, 3], infos
        for info in infos:
            assert (Path(info.uri) / MANIFEST_NAME).stat().st_size > 0
            assert 0 < (Path(info.uri) / "model" / "weights.bin").stat().st_size < 100_000  # torn
        assert all(info.reason.startswith("size mismatch in ") for info in infos), infos  # its manifest is whole
        assert not [info for info in CheckpointStore(store_url).list(verify=True) if info.is_committed]
