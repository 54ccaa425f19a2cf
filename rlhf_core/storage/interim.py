"""The slots of the snapshots between commits (`rlhf_core.rank.interim` takes them, the driver picks one to start
a new group from): every K steps each rank copies its DeepSpeed state into one of two slots in its node's tmpfs,
which outlive its process.

A slot keeps each state file as two files: its tensors' bytes back to back (`.bin`, written in place through a
shared mapping the rank keeps (`SlotFiles`), so from the second snapshot on a snapshot is one memory copy into
resident pages, with no serialisation) and the rest of the state dict (`.skel`: containers, numbers, strings, and
where each tensor lies, read back as plain data like a checkpoint file). A rank removes its marker from the slot it
writes, copies, then writes the marker again (`rank{R}.json`: step, file sizes, metrics, K), so a slot cut short is
never read; the other slot still holds the snapshot before. `materialize` rebuilds DeepSpeed's files from the slots.

The slots lie in `{tmpfs}/rlhf-interim-{driver host}-{driver pid}-{key}/{node id}/slot_{0,1}/`: the key names one
command's stage on one group shape, so a snapshot never crosses commands (a resume from the store uses commits
only) or world sizes. A group on several nodes also keeps a copy of each rank's slot on the next node of its ring
(`store_copy`, written by that node's `NodeSnapshots`), so the loss of a node leaves each of its ranks' snapshots
on a peer; a node folder then holds its own ranks' slots and copies of its peer's, in the same layout.
docs/design-notes.md ("Snapshots between commits") has the choice of K and the memory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import mmap
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlhf_core.processes import process_exists

PREFIX = "rlhf-interim-"
NUM_SLOTS = 2  # snapshots a rank holds: the newest whole one, and the one it writes over the older
# K is the fewest steps over which one snapshot's stall costs at most this share of the training time
# (`rlhf_core.rank.interim` chooses it; the placement line and the flag's help say it).
STALL_BUDGET = 0.05
_TENSOR_TAG = "__rlhf_interim_tensor__"  # a tensor's place in a `.skel` file: (tag, offset, dtype, shape)
_ALIGNMENT = 64


@dataclass(frozen=True)
class InterimPlan:
    """What the driver hands each rank at set-up: the folder key (the command, stage and group shape), the
    interval (0: the run chooses), the group's size, and the driver's host and pid (a dead driver's folders on its
    own host are removed)."""

    key: str
    every_steps: int
    world_size: int
    driver_host: str = ""
    driver_pid: int = 0
    copy_to: Any = None  # the `NodeSnapshots` actor of the next node of the group's ring (None: one node)

    @property
    def folder_name(self) -> str:
        return f"{PREFIX}{self.driver_host}-{self.driver_pid}-{self.key}"


def interim_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def node_folder(plan: InterimPlan, node_id: str, root: str | None = None) -> str:
    return os.path.join(root or interim_root(), plan.folder_name, node_id)


def _slots(folder: str) -> list[str]:
    return [os.path.join(folder, f"slot_{index}") for index in range(NUM_SLOTS)]


def _marker_path(slot: str, rank: int) -> str:
    return os.path.join(slot, f"rank{rank}.json")


def _read_marker(slot: str, rank: int) -> dict | None:
    try:
        with open(_marker_path(slot, rank)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _markers_of_step(folder: str, step: int, world_size: int) -> dict[int, tuple[str, dict]] | None:
    """Each rank's (slot, marker) holding `step` whole under `folder`; None when a rank has none (what
    `materialize` takes)."""
    found = {rank: slot_holding(folder, rank, step) for rank in range(world_size)}
    return None if None in found.values() else {rank: held for rank, held in found.items() if held is not None}


def whole_steps(folder: str, world_size: int) -> list[int]:
    """The steps under `folder` (a node's) that every one of `world_size` ranks finished writing there: each
    rank's marker present, each file it names there at its size. Oldest first."""
    held = holdings(folder, world_size)
    per_rank = [set(held.get(rank, {})) for rank in range(world_size)]
    return sorted(set.intersection(*per_rank)) if per_rank else []


def _whole_slots(folder: str, rank: int) -> Iterator[tuple[str, dict]]:
    """`rank`'s (slot, marker) under `folder` whose files are all there at their sizes."""
    for slot in _slots(folder):
        marker = _read_marker(slot, rank)
        if marker is not None and _files_intact(slot, marker["files"]):
            yield slot, marker


def holdings(folder: str, world_size: int) -> dict[int, dict[int, dict]]:
    """Per rank, the steps `folder` (a node's) holds whole for it, with their markers: the rank's own slots when it
    ran there, or the copies of a peer node's rank."""
    held: dict[int, dict[int, dict]] = {}
    for rank in range(world_size):
        for _, marker in _whole_slots(folder, rank):
            held.setdefault(rank, {})[marker["step"]] = marker
    return held


def slot_holding(folder: str, rank: int, step: int) -> tuple[str, dict] | None:
    """The (slot, marker) under `folder` holding `rank`'s snapshot of `step` whole, or None."""
    return next(((slot, marker) for slot, marker in _whole_slots(folder, rank) if marker["step"] == step), None)


def read_slot(folder: str, rank: int, step: int, names: list[str] | None = None) -> tuple[dict, dict[str, bytes]]:
    """`rank`'s snapshot of `step` under `folder`: its marker and the bytes of its files (`names`: only these), to
    send to another node. FileNotFoundError when it is not whole there."""
    held = slot_holding(folder, rank, step)
    if held is None:
        raise FileNotFoundError(f"rank {rank}'s snapshot of step {step} is not whole in {folder}")
    slot, marker = held
    files = {}
    for relative in (marker["files"] if names is None else names):
        with open(os.path.join(slot, relative), "rb") as handle:
            files[relative] = handle.read()
    if slot_holding(folder, rank, step) is None:  # rewritten while read
        raise FileNotFoundError(f"rank {rank}'s snapshot of step {step} in {folder} was replaced while read")
    return marker, files


def store_copy(folder: str, rank: int, marker: dict, files: dict[str, bytes]) -> None:
    """A copy of `rank`'s slot (its `marker` and every file's bytes, from `read_slot`) into `folder`, a peer node's:
    into the slot that holds the same step, else the older one; marker last, as a rank writes its own."""
    slot = next((slot for slot in _slots(folder) if (_read_marker(slot, rank) or {}).get("step") == marker["step"]),
                None) or older_slot(folder, rank)
    open_slot(slot, rank)
    for relative, data in files.items():
        with _replacing(os.path.join(slot, relative)) as partial, open(partial, "wb") as handle:
            handle.write(data)
    close_slot(slot, rank, marker)


def _files_intact(slot: str, files: dict[str, int]) -> bool:
    for relative, size in files.items():
        try:
            if os.path.getsize(os.path.join(slot, relative)) != size:
                return False
        except OSError:
            return False
    return True


def recorded(marker: dict) -> tuple[list[dict[str, float]], int]:
    """What rank 0's marker of a step recorded: the metrics of the steps between the last commit and that step,
    and the interval K the snapshots were taken at."""
    return list(marker.get("metrics", [])), int(marker.get("interval", 0))


def whole_at(folder: str, step: int, world_size: int) -> dict[int, tuple[str, dict]]:
    """Each rank's (slot, marker) of `step` under `folder`, every rank's whole there (FileNotFoundError if not)."""
    held = _markers_of_step(folder, step, world_size)
    if held is None:
        raise FileNotFoundError(f"the snapshot of step {step} is no longer whole in {folder}")
    return held


def materialize(held: dict[int, tuple[str, dict]], into: str, wanted: Callable[[list[str]], list[str]]) -> None:
    """Rebuild DeepSpeed's files of one step from every rank's slot (`held`: rank -> (slot folder, marker), from
    `whole_at`, or slots fetched from peers) into the folder `into`, as a commit holds them; `wanted(paths)`: the
    ones this rank reads. Each `.skel` is read as plain data, as checkpoint files are."""
    import torch

    from rlhf_core.storage.safe_load import _load_plain_data

    sources = {relative[:-len(".skel")]: slot for slot, marker in held.values()
               for relative in marker["files"] if relative.endswith(".skel")}
    for relative in wanted(sorted(sources)):
        slot = sources[relative]
        with open(os.path.join(slot, relative + ".bin"), "rb") as handle:
            data = torch.frombuffer(bytearray(handle.read()) or bytearray(1), dtype=torch.uint8)
        skeleton = _load_plain_data(os.path.join(slot, relative + ".skel"), slot, map_location="cpu")
        target = os.path.join(into, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        torch.save(_rebuilt(skeleton, data), target)


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove the snapshot folders of drivers on this host that no longer run (a command that ended or died);
    returns them. Another host's driver cannot be checked from here: its folders stay until the node restarts
    (tmpfs), or a driver on that host removes them."""
    removed, host = [], socket.gethostname()
    for path in glob.glob(os.path.join(root or interim_root(), f"{PREFIX}*")):
        owner = os.path.basename(path)[len(PREFIX):]
        if not owner.startswith(f"{host}-"):
            continue
        pid = owner[len(host) + 1:].split("-", 1)[0]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_for_driver(root: str | None = None) -> None:
    """Remove this process's (the driver's) snapshot folders on its own host: at the command's end."""
    for path in glob.glob(os.path.join(root or interim_root(), f"{PREFIX}{socket.gethostname()}-{os.getpid()}-*")):
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class SlotFiles:
    """One rank's writer into its slots: the shared mappings of its `.bin` files, kept between snapshots (a new
    mapping would fault every page in again)."""

    _mappings: dict[str, Any] = field(default_factory=dict)  # a slot file's path -> (mmap, uint8 tensor over it)

    def store(self, slot: str, relative: str, state: Any) -> dict[str, int]:
        """One state dict into `slot`: its tensors' bytes copied into the slot's mapped `.bin` (made anew when the
        layout changed), the rest written as `.skel`. Returns both files' sizes."""
        import torch

        tensors: list[Any] = []
        places: list[tuple[int, int]] = []
        skeleton = _skeleton(state, tensors, places)
        total = places[-1][0] + places[-1][1] if places else 0
        buffer = self._mapped(os.path.join(slot, relative + ".bin"), total)
        for tensor, (offset, num_bytes) in zip(tensors, places):
            if num_bytes:
                buffer[offset:offset + num_bytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        skel_path = os.path.join(slot, relative + ".skel")
        with _replacing(skel_path) as partial:
            torch.save(skeleton, partial)
        return {relative + ".bin": total, relative + ".skel": os.path.getsize(skel_path)}

    def _mapped(self, path: str, size: int) -> Any:
        """A uint8 tensor over `path` (`size` bytes), mapped shared: kept between snapshots."""
        import torch

        kept = self._mappings.get(path)
        if kept is not None and len(kept[0]) == max(size, 1) and os.path.exists(path):
            return kept[1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a+b") as handle:
            handle.truncate(size)
            if size:  # reserved now: a full tmpfs is an OSError here, not a SIGBUS at the first page written
                os.posix_fallocate(handle.fileno(), 0, size)
            mapping = mmap.mmap(handle.fileno(), max(size, 1)) if size else mmap.mmap(-1, 1)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._mappings[path] = (mapping, buffer)
        return buffer


def older_slot(folder: str, rank: int) -> str:
    """The slot `rank` writes next: one without its marker, else the one with the older step."""
    steps = {slot: (_read_marker(slot, rank) or {"step": -1})["step"] for slot in _slots(folder)}
    return min(steps, key=lambda slot: steps[slot])


def open_slot(slot: str, rank: int) -> None:
    """`rank` starts writing `slot`: its marker goes first, so until `close_slot` the slot is not whole."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(_marker_path(slot, rank))


def close_slot(slot: str, rank: int, marker: dict[str, Any]) -> None:
    """`rank` has written `slot`: its marker (step, files and their sizes, metrics, interval) makes it whole."""
    _write_json(_marker_path(slot, rank), marker)


def copy_small_files(staging: str, slot: str) -> dict[str, int]:
    """The files a save wrote itself into `staging` (DeepSpeed's recovery script), copied into `slot`."""
    return {relative: _replace_file(os.path.join(slot, relative), os.path.join(staging, relative))
            for relative in _files_under(staging)}


def forget_after(folder: str, rank: int, step: int) -> None:
    """`rank`'s markers of steps after `step` removed (a new group starts from `step`)."""
    for slot in _slots(folder):
        marker = _read_marker(slot, rank)
        if marker is not None and marker["step"] > step:
            os.remove(_marker_path(slot, rank))


def _skeleton(item: Any, tensors: list[Any], places: list[tuple[int, int]]) -> Any:
    """`item` with each tensor replaced by (tag, offset, dtype, shape), the tensor appended to `tensors` and its
    (offset, bytes) to `places`, each offset aligned for any element size."""
    import torch

    if torch.is_tensor(item):
        offset = places[-1][0] + places[-1][1] if places else 0
        offset += -offset % _ALIGNMENT
        num_bytes = item.numel() * item.element_size()
        tensors.append(item.detach())
        places.append((offset, num_bytes))
        return (_TENSOR_TAG, offset, str(item.dtype).removeprefix("torch."), list(item.shape))
    if isinstance(item, dict):
        return type(item)({key: _skeleton(value, tensors, places) for key, value in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(_skeleton(value, tensors, places) for value in item)
    return item


def _rebuilt(item: Any, data: Any) -> Any:
    """The inverse of `_skeleton`: each tensor's place replaced by a tensor over `data` (the `.bin` bytes)."""
    import torch

    if isinstance(item, tuple) and len(item) == 4 and item[0] == _TENSOR_TAG:
        _, offset, dtype_name, shape = item
        dtype = getattr(torch, dtype_name)
        num_bytes = math.prod(shape) * dtype.itemsize
        if not num_bytes:
            return torch.empty(shape, dtype=dtype)
        # a storage of its own, as DeepSpeed saved it (a view would save all of `data` with every tensor's file)
        return data[offset:offset + num_bytes].view(dtype).view(shape).clone()
    if isinstance(item, dict):
        return type(item)({key: _rebuilt(value, data) for key, value in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(_rebuilt(value, data) for value in item)
    return item


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
    """A temporary name beside `path` to write, renamed to `path` once written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}-{threading.get_ident()}.partial"  # a keeper writes several ranks' at once
    yield partial
    os.replace(partial, path)


def _replace_file(target: str, source: str) -> int:
    with _replacing(target) as partial:
        shutil.copyfile(source, partial)
    return os.path.getsize(target)


def _write_json(path: str, value: dict) -> None:
    with _replacing(path) as partial, open(partial, "w") as handle:
        json.dump(value, handle)


def _files_under(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
            for parent, _, names in os.walk(folder) for name in names]
