"""The in-memory snapshot of a rank's share of a checkpoint, so training goes on while it is written: DeepSpeed's
state and the Hugging Face weights are kept as tensor copies (`tensors_kept_in_memory`), small files go to a folder
in tmpfs when it has room, and the rank's background writer streams both into the store (`write_state`).
docs/design-notes.md ("The in-memory snapshot") says why, and how stale folders and page alignment are handled.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator

from rlhf_core.processes import process_exists
from rlhf_core.storage.direct_io import ALIGNMENT, IN_PLACE_MIN_BYTES

if TYPE_CHECKING:
    import torch

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
            from rlhf_core.notices import warn_once
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
def torch_save_options(page_aligned: bool = True):
    """torch.save without its per-record CRC32 (the manifest's checksum covers every byte instead), and, when
    `page_aligned`, with each tensor's bytes at a page-aligned place in the file (`ALIGNMENT`, where torch's default
    is 64), so the O_DIRECT writer writes them from where they lie. torch.load reads either."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6 has neither switch
        yield
        return
    previous = config.save.compute_crc32, config.save.storage_alignment
    config.save.compute_crc32 = False
    if page_aligned:
        config.save.storage_alignment = ALIGNMENT
    try:
        yield
    finally:
        config.save.compute_crc32, config.save.storage_alignment = previous


def pays_to_align(state: Any) -> bool:
    """Whether putting each of `state`'s tensors on a page in its file pays: it holds a tensor the writer can
    write from where it lies (`IN_PLACE_MIN_BYTES` or more), and the padding (under `ALIGNMENT` per tensor) adds at
    most 1% to the file. A small model's state would otherwise grow by half or more (100 tensors of a few KiB each
    padded to 4 KiB), which is also what the checkpoint-size alert looks for."""
    sizes = [_num_bytes(tensor) for tensor in _tensors_in(state)]
    return bool(sizes) and max(sizes) >= IN_PLACE_MIN_BYTES and len(sizes) * ALIGNMENT <= sum(sizes) // 100


def _tensors_in(item: Any) -> Iterator[Any]:
    import torch

    if torch.is_tensor(item):
        yield item
    elif isinstance(item, dict):
        for value in item.values():
            yield from _tensors_in(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _tensors_in(value)


@contextlib.contextmanager
def tensors_kept_in_memory(engines: Iterable[Any], folder: str, reuse: dict[str, Any] | None = None
                           ) -> Iterator[dict[str, Any]]:
    """While DeepSpeed `engines` save into `folder`, keep each state dict they would write there in memory
    instead: a copy of its tensors (DeepSpeed's own engine clones before `torch.save` too), made into the
    buffers of `reuse` (the last snapshot's, once written) where shapes match, so a snapshot after the first
    costs no page faults. Yields the dict that fills up: path relative to `folder` -> state dict (see
    `write_state`)."""
    import transformers.modeling_utils

    kept: dict[str, Any] = {}
    buffers = reuse or {}

    def keep_state(relative: str, state_dict: Any) -> None:
        kept[relative] = copy_into(buffers.get(relative), state_dict)

    def keep_safetensors(tensors: dict[str, torch.Tensor], filename: str | os.PathLike[str],
                         metadata: dict[str, str] | None = None) -> None:
        relative = _relative(filename, folder)
        kept[relative] = safetensors_in_memory(tensors, metadata, buffers.get(relative))

    original_save_file = transformers.modeling_utils.safe_save_file
    with state_dicts_handed_to(engines, folder, keep_state):
        transformers.modeling_utils.safe_save_file = keep_safetensors
        try:
            yield kept
        finally:
            transformers.modeling_utils.safe_save_file = original_save_file


@contextlib.contextmanager
def state_dicts_handed_to(engines: Iterable[Any], folder: str, store: Callable[[str, Any], None]) -> Iterator[None]:
    """While DeepSpeed `engines` save into `folder`, hand each state dict they would write there to
    `store(path relative to folder, state dict)` instead of `torch.save` (a checkpoint engine that writes nothing;
    `store` copies every tensor, so DeepSpeed need not clone them first)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class HandedOver(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            store(_relative(path, folder), state_dict)

        def preserves_storage_sharing(self) -> bool:
            return False

    engines = list(engines)
    originals = [engine.checkpoint_engine for engine in engines]
    try:
        for engine in engines:
            engine.checkpoint_engine = HandedOver()
        yield
    finally:
        for engine, original in zip(engines, originals):
            engine.checkpoint_engine = original


def _relative(path: str | os.PathLike[str], folder: str) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")


@dataclass
class SafetensorsFile:
    """A safetensors file kept in memory: its tensors (CPU copies) and its header's metadata. `data`, when set, is
    the file's data section, one page-aligned buffer the tensors are views of, in the file's order."""
    tensors: dict[str, Any]
    metadata: dict[str, str] | None
    data: Any = None


def safetensors_in_memory(tensors: dict[str, Any], metadata: dict[str, str] | None, previous: Any) -> SafetensorsFile:
    """`tensors` copied into one page-aligned buffer laid out as the file's data section (`previous`'s buffer when
    its layout is the same), so the writer writes the whole section from memory in one go."""
    import torch

    if any(tensor.dtype not in _safetensors_dtypes() for tensor in tensors.values()):
        previous_tensors = previous.tensors if isinstance(previous, SafetensorsFile) else None
        return SafetensorsFile(copy_into(previous_tensors, tensors), metadata)
    layout = [(name, tensors[name].dtype, tuple(tensors[name].shape)) for name in _file_order(tensors)]
    if isinstance(previous, SafetensorsFile) and previous.data is not None and \
            [(name, view.dtype, tuple(view.shape)) for name, view in previous.tensors.items()] == layout:
        data = previous.data
    else:
        data = page_aligned_empty((sum(_num_bytes(tensors[name]) for name, _, _ in layout),), torch.uint8)
    views, offset = {}, 0
    for name, dtype, shape in layout:  # larger elements first: each view's offset is a multiple of its element size
        num_bytes = _num_bytes(tensors[name])
        views[name] = data[offset:offset + num_bytes].view(dtype).view(shape).copy_(tensors[name].detach())
        offset += num_bytes
    return SafetensorsFile(views, metadata, data)


def page_aligned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """A new CPU tensor whose memory starts on a page (an anonymous mmap of its own) when it is large enough for
    the O_DIRECT writer to write it from where it lies (`rlhf_core.storage.direct_io`); torch's allocator aligns
    to 64 bytes only."""
    import torch

    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes < IN_PLACE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype).view(shape)


def copy_into(previous: Any, item: Any) -> Any:
    """`item` with every tensor copied to CPU memory of its own (`page_aligned_empty`): into the same-shaped tensor
    at the same place in `previous` when there is one, else a new one."""
    import torch

    if torch.is_tensor(item):
        item = item.detach()
        if torch.is_tensor(previous) and previous.shape == item.shape and previous.dtype == item.dtype:
            return previous.copy_(item)
        return page_aligned_empty(tuple(item.shape), item.dtype).copy_(item)
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
    with torch_save_options(page_aligned=pays_to_align(state)):
        torch.save(state, target)


def write_safetensors(kept: SafetensorsFile, target: BinaryIO) -> None:
    """`kept` in the safetensors format (safetensors' Python API builds the whole file as one `bytes` first, or
    wants a path): an 8-byte little-endian header length, the JSON header (metadata first, then each tensor's
    dtype, shape and byte range) padded with spaces, then the tensors back to back, larger elements first, by
    name. Where this departs from `safetensors.torch.save`: when the data section is large enough to be written
    from where it lies (`IN_PLACE_MIN_BYTES`), the header is padded to end on `ALIGNMENT` (the format allows any
    padding of spaces) rather than on 8 bytes, so the data section, written from `kept.data` in one piece, lands
    aligned for O_DIRECT. The tensors and metadata read back the same."""
    from safetensors.torch import save

    if kept.data is None:  # a dtype named below only by safetensors itself
        target.write(save(kept.tensors, kept.metadata))
        return
    header: dict[str, Any] = {"__metadata__": kept.metadata} if kept.metadata else {}
    offset, dtype_names = 0, _safetensors_dtypes()
    for name, tensor in kept.tensors.items():
        header[name] = {"dtype": dtype_names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + _num_bytes(tensor)]}
        offset += _num_bytes(tensor)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    page_aligned = offset >= IN_PLACE_MIN_BYTES  # a small file is written through the writer's buffers anyway
    encoded += b" " * (-(8 + len(encoded)) % (ALIGNMENT if page_aligned else 8))
    target.write(struct.pack("<Q", len(encoded)) + encoded)
    if offset:
        target.write(kept.data.numpy().data)


def _file_order(tensors: dict[str, Any]) -> list[str]:
    return sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))


def _num_bytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _safetensors_dtypes() -> dict[Any, str]:
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
