"""The in-memory snapshot of a rank's share of a checkpoint, so training goes on while it is written.

At a chunk boundary each rank saves its share of the checkpoint. DeepSpeed's state files are not
written then: a checkpoint engine (`tensors_kept_in_memory`) keeps each state dict DeepSpeed hands it as
a clone of its tensors, which costs one in-memory copy. The rest (the Hugging Face copy, small files)
goes into a folder in memory: `/dev/shm` (tmpfs) when it has room, else the temporary folder (the page
cache absorbs it until it is written back). The rank's background writer then serializes the kept
state dicts straight into the store and streams the folder's files there, hashing as it writes
(`rlhf_core.storage.checkpoint.CheckpointStore.upload_tree`), and removes the folder.

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
from typing import Any, BinaryIO, Iterable, Iterator

from rlhf_core.processes import process_exists

SHM_ROOT = "/dev/shm"
PREFIX = "rlhf-snapshot-"
# Room to leave in tmpfs beside a snapshot: it is RAM, shared with the training process and Ray's object store.
SHM_HEADROOM = 2.0


def snapshot_folder(rank: int, expected_bytes: int) -> str:
    """A new empty folder for one rank's snapshot of about `expected_bytes`: in tmpfs when it fits with
    headroom, else in the temporary folder."""
    remove_stale_snapshots()
    root = tempfile.gettempdir()
    if os.path.isdir(SHM_ROOT):
        free_bytes = shutil.disk_usage(SHM_ROOT).free
        if free_bytes > SHM_HEADROOM * expected_bytes:
            root = SHM_ROOT
        else:
            from rlhf_core.rank.ds_config import warn_once
            from rlhf_core.errors import human_bytes

            warn_once(f"{SHM_ROOT} has {human_bytes(free_bytes)} free, less than {SHM_HEADROOM:g}x the "
                      f"{human_bytes(expected_bytes)} of rank {rank}'s snapshot, so it snapshots into {root} "
                      f"instead (the page cache, slower when memory is short); a larger {SHM_ROOT} (docker "
                      "--shm-size, a Kubernetes emptyDir with medium Memory) avoids that.", key="snapshot-shm")
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


@contextlib.contextmanager
def tensors_kept_in_memory(engines: Iterable[Any], folder: str, reuse: dict[str, Any] | None = None
                           ) -> Iterator[dict[str, Any]]:
    """While DeepSpeed `engines` save into `folder`, keep each state dict they would write there in memory
    instead: a copy of its tensors (DeepSpeed's own engine clones before `torch.save` too), made into the
    buffers of `reuse` (the last snapshot's, once written) where shapes match, so a snapshot after the first
    costs no page faults. Yields the dict that fills up: path relative to `folder` -> state dict (see
    `write_state`)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    kept: dict[str, Any] = {}
    reuse = reuse or {}

    class KeepInMemory(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            relative_path = os.path.relpath(path, folder).replace(os.sep, "/")
            kept[relative_path] = copy_into(reuse.get(relative_path), state_dict)

        def preserves_storage_sharing(self) -> bool:
            return False  # save() copies every tensor, so DeepSpeed need not clone them first

    engines = list(engines)
    originals = [engine.checkpoint_engine for engine in engines]
    try:
        for engine in engines:
            engine.checkpoint_engine = KeepInMemory()
        yield kept
    finally:
        for engine, original in zip(engines, originals):
            engine.checkpoint_engine = original


def copy_into(previous: Any, item: Any) -> Any:
    """`item` with every tensor copied to CPU memory of its own: into the same-shaped tensor at the same place
    in `previous` when there is one, else a new one."""
    import torch

    if torch.is_tensor(item):
        item = item.detach()
        if torch.is_tensor(previous) and previous.shape == item.shape and previous.dtype == item.dtype:
            return previous.copy_(item)
        return item.clone() if item.device.type == "cpu" else item.to("cpu")
    if isinstance(item, dict):
        previous = previous if isinstance(previous, dict) else {}
        return type(item)({key: copy_into(previous.get(key), value) for key, value in item.items()})
    if isinstance(item, (list, tuple)):
        if not (isinstance(previous, (list, tuple)) and len(previous) == len(item)):
            previous = [None] * len(item)
        return type(item)(copy_into(old, value) for old, value in zip(previous, item))
    return item


def write_state(state: Any, target: BinaryIO) -> None:
    """Serialize a kept state dict into `target` (a file object), as DeepSpeed would have into a file."""
    import torch

    with without_zip_crc32():
        torch.save(state, target)
