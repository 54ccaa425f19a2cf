"""The in-memory snapshot of a rank's share of a checkpoint, so training goes on while it is written.

At a chunk boundary each rank saves its share of the checkpoint. Its large files are not written then:
a checkpoint engine (`tensors_kept_in_memory`) keeps each state dict DeepSpeed hands it as a clone of its
tensors, and the Hugging Face copy's safetensors files are kept the same way (transformers'
`save_pretrained` hands its shards to `safe_save_file`, which the context replaces), each costing one
in-memory copy. The rest (config, tokenizer, small files) goes into a folder in memory: `/dev/shm`
(tmpfs) when it has room, else the temporary folder. The rank's background writer then serializes the
kept state straight into the store (`write_state`: `torch.save`, or the safetensors format) and streams
the folder's files there, hashing as it writes (`rlhf_core.storage.checkpoint.CheckpointStore.upload_tree`),
and removes the folder. Keeping the HF copy in memory too spares the stall its serialization into tmpfs,
whose fresh pages a VM that hands freed memory to its host faults back in one by one.

A rank killed mid-write leaves its folder behind, and tmpfs holds it in RAM until reboot, so every
new snapshot first removes the folders of processes that no longer exist (the folder's name carries its
owner's pid). torch's zip writer computes a CRC32 per tensor record by default; the manifest's sha256
already covers every byte, so snapshots are written without it (torch reads them as usual).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
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
    import transformers.modeling_utils
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    kept: dict[str, Any] = {}
    reuse = reuse or {}

    def relative(path: str) -> str:
        return os.path.relpath(path, folder).replace(os.sep, "/")

    class KeepInMemory(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            kept[relative(path)] = copy_into(reuse.get(relative(path)), state_dict)

        def preserves_storage_sharing(self) -> bool:
            return False  # save() copies every tensor, so DeepSpeed need not clone them first

    def keep_safetensors(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        previous = reuse.get(relative(filename))
        previous_tensors = previous.tensors if isinstance(previous, SafetensorsFile) else None
        kept[relative(filename)] = SafetensorsFile(copy_into(previous_tensors, tensors), metadata)

    engines = list(engines)
    originals = [engine.checkpoint_engine for engine in engines]
    original_save_file = transformers.modeling_utils.safe_save_file
    try:
        for engine in engines:
            engine.checkpoint_engine = KeepInMemory()
        transformers.modeling_utils.safe_save_file = keep_safetensors
        yield kept
    finally:
        transformers.modeling_utils.safe_save_file = original_save_file
        for engine, original in zip(engines, originals):
            engine.checkpoint_engine = original


@dataclass
class SafetensorsFile:
    """A safetensors file kept in memory: its tensors (CPU copies) and its header's metadata."""
    tensors: dict[str, Any]
    metadata: dict[str, str] | None


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
    """Serialize a kept state into `target` (a file object), as DeepSpeed or transformers would have into a file."""
    import torch

    if isinstance(state, SafetensorsFile):
        write_safetensors(state, target)
        return
    with without_zip_crc32():
        torch.save(state, target)


def write_safetensors(kept: SafetensorsFile, target: BinaryIO) -> None:
    """`kept` in the safetensors format, streamed from the tensors' own memory (safetensors' Python API builds
    the whole file as one `bytes` first, or wants a path). The same bytes as `safetensors.torch.save`: an
    8-byte little-endian header length, the JSON header (metadata first, then each tensor's dtype, shape and
    byte range) padded with spaces to 8 bytes, then the tensors back to back, larger elements first, by name."""
    from safetensors.torch import save

    tensors, dtype_names = kept.tensors, _safetensors_dtypes()
    if any(tensor.dtype not in dtype_names for tensor in tensors.values()):
        target.write(save(tensors, kept.metadata))  # a dtype named below only by safetensors itself
        return
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": kept.metadata} if kept.metadata else {}
    offset = 0
    for name in names:
        num_bytes = tensors[name].numel() * tensors[name].element_size()
        header[name] = {"dtype": dtype_names[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    target.write(struct.pack("<Q", len(encoded)) + encoded)
    for name in names:
        if tensors[name].numel():
            target.write(_raw_bytes(tensors[name]))


def _raw_bytes(tensor: Any) -> memoryview:
    """The tensor's bytes as they lie in memory (little-endian on every host torch ships for), without a copy."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _safetensors_dtypes() -> dict[Any, str]:
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
