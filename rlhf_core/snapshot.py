"""Where a rank puts the in-memory snapshot of a checkpoint, so training goes on while it is written.

At a chunk boundary each rank saves its share of the checkpoint (DeepSpeed state and the Hugging Face
copy) into a folder in memory: `/dev/shm` (tmpfs) when it has room, else the temporary folder (the page
cache absorbs it until it is written back). Writing there costs about one in-memory copy of the
tensors; the rank's background writer then streams the files into the store, hashing as it writes
(`rlhf_core.checkpoint.upload_tree`), and removes the folder.

A rank killed mid-write leaves its folder behind, and tmpfs holds it in RAM until reboot, so every
new snapshot first removes the folders of processes that no longer exist (the folder's name carries its
owner's pid). torch's zip writer computes a CRC32 per tensor record by default; the manifest's sha256
already covers every byte, so snapshots are written without it (torch reads them as usual).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile

from rlhf_core.lease import process_exists

SHM_ROOT = "/dev/shm"
PREFIX = "rlhf-snapshot-"
# Room to leave in tmpfs beside a snapshot: it is RAM, shared with the training process and Ray's object store.
SHM_HEADROOM = 2.0


def snapshot_folder(rank: int, expected_bytes: int) -> str:
    """A new empty folder for one rank's snapshot of about `expected_bytes`: in tmpfs when it fits with
    headroom, else in the temporary folder."""
    remove_stale_snapshots()
    root = tempfile.gettempdir()
    if os.path.isdir(SHM_ROOT) and shutil.disk_usage(SHM_ROOT).free > SHM_HEADROOM * expected_bytes:
        root = SHM_ROOT
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-rank{rank}-", dir=root)


def remove_stale_snapshots() -> list[str]:
    """Remove the snapshot folders of dead processes (a rank killed mid-write); returns them."""
    removed = []
    for root in {SHM_ROOT, tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(root, f"{PREFIX}*")):
            owner = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not process_exists(int(owner)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


@contextlib.contextmanager
def without_zip_crc32():
    """torch.save without its per-record CRC32 (the manifest's sha256 checks every byte instead)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6 has no switch
        yield
        return
    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous
