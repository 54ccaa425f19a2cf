"""Snapshots between commits: every K steps each rank copies its training state (DeepSpeed's state dicts, the step,
the controller state, the metrics since the last commit) into memory, then a thread writes the copy into a folder
in this node's tmpfs while training goes on. The folder outlives the rank's process, so a replaced rank (and its
peers) start from the newest snapshot every rank of the group finished, not from the last commit. Not in OpenRLHF,
whose ranks go back to the last `save_steps` checkpoint.

The folders are `{tmpfs}/rlhf-interim-{key}/{node id}/step_N/`: the key names one command's stage on one group
shape, so a snapshot never crosses commands (a resume from the store uses commits only), nodes (a lost node's
snapshot is never read from elsewhere) or world sizes. Each rank writes its files under temporary names, renames
them, then writes its marker (`rank{R}.json`: its files and sizes, the metrics): a step is whole when every rank's
marker is there and its files have their sizes. A rank keeps at most two (`KEEP`): the newest whole one and the
one being written. docs/design-notes.md ("Snapshots between commits") has the choice of K and the memory.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import math
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterable

from rlhf_core.processes import process_exists

PREFIX = "rlhf-interim-"
KEEP = 2  # snapshots a rank holds in tmpfs: the newest whole one and the one being written
_STEP_TIMES_KEPT = 16


@dataclass(frozen=True)
class InterimPlan:
    """What the driver hands each rank at set-up: the folder key (the command, stage and group shape), the
    interval (0: the run chooses, the fewest steps at which the copy keeps up), the group's size, and the
    driver's host and pid (a dead driver's folders on its own host are removed)."""

    key: str
    every_steps: int
    world_size: int
    driver_host: str = ""
    driver_pid: int = 0

    @property
    def folder_name(self) -> str:
        return f"{PREFIX}{self.driver_host}-{self.driver_pid}-{self.key}"


def interim_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def node_folder(plan: InterimPlan, node_id: str, root: str | None = None) -> str:
    return os.path.join(root or interim_root(), plan.folder_name, node_id)


def _step_of(path: str) -> int:
    name = os.path.basename(path)
    return int(name[len("step_"):]) if name.startswith("step_") and name[len("step_"):].isdigit() else -1


def _marker(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, f"rank{rank}.json")


def _read_marker(step_dir: str, rank: int) -> dict | None:
    try:
        with open(_marker(step_dir, rank)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def whole_steps(folder: str, world_size: int) -> list[int]:
    """The steps under `folder` (a node's) that every one of `world_size` ranks finished writing there: each
    rank's marker present, each file it names there at its size. Oldest first."""
    steps = []
    for step_dir in glob.glob(os.path.join(folder, "step_*")):
        markers = [_read_marker(step_dir, rank) for rank in range(world_size)]
        if all(marker is not None and _files_intact(step_dir, marker["files"]) for marker in markers):
            steps.append(_step_of(step_dir))
    return sorted(step for step in steps if step >= 0)


def _files_intact(step_dir: str, files: dict[str, int]) -> bool:
    for relative, size in files.items():
        try:
            if os.path.getsize(os.path.join(step_dir, relative)) != size:
                return False
        except OSError:
            return False
    return True


def recorded(folder: str, step: int) -> tuple[list[dict[str, float]], int]:
    """What rank 0's marker of `step` recorded: the metrics of the steps between the last commit and `step`, and
    the interval K the snapshots were taken at."""
    marker = _read_marker(os.path.join(folder, f"step_{step}"), 0) or {}
    return list(marker.get("metrics", [])), int(marker.get("interval", 0))


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove the snapshot folders of drivers on this host that no longer run (a command that ended or died);
    returns them. Another host's driver cannot be checked from here: its folders stay until that driver's host
    cleans them or the node restarts (tmpfs)."""
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
class InterimSnapshots:
    """One rank's snapshots between commits (`folder`: its node's). `due` says whether this rank is ready for one
    at a step boundary (the ranks agree before any takes one: DeepSpeed's save is a collective), `take` copies the
    state and starts its write, `restore_from` forgets what a failed group wrote past the step a new group
    starts from."""

    plan: InterimPlan
    rank: int
    folder: str
    last_step: int = 0  # the step of the last snapshot taken, or the one the rank started from
    interval: int = 1  # K: steps between two snapshots
    copy_seconds: float = 0.0  # the last snapshot's stall: the copy into memory
    write_seconds: float = 0.0  # the last snapshot's write into tmpfs, beside training
    _step_seconds: list[float] = field(default_factory=list)
    _writer: threading.Thread | None = None
    _buffers: dict = field(default_factory=dict)  # the last written copy's tensors: reused, no page faults
    write_error: BaseException | None = None

    def __post_init__(self) -> None:
        self.interval = self.plan.every_steps or 1

    def step_done(self, seconds: float) -> None:
        self._step_seconds = [*self._step_seconds[-_STEP_TIMES_KEPT + 1:], seconds]

    def writing(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def due(self, step: int) -> bool:
        """Whether this rank would take a snapshot at `step`: K steps since the last, and its last write done."""
        return step - self.last_step >= self.interval and not self.writing()

    def take(self, step: int, engines: Iterable[Any], save: Callable[[str], None],
             metrics: list[dict[str, float]]) -> None:
        """Copy the state of `step` into memory (`save` writes it into a folder, as DeepSpeed would; the copy
        keeps its tensors instead), then write it into tmpfs in a thread. `metrics`: the steps' since the last
        commit."""
        from rlhf_core.rank.snapshot import tensors_kept_in_memory

        started = time.perf_counter()
        staging = tempfile.mkdtemp(prefix=f"{PREFIX}staging-{os.getpid()}-")
        try:
            with tensors_kept_in_memory(engines, staging, self._buffers) as kept:
                save(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._buffers = {}
        self.copy_seconds, self.last_step = time.perf_counter() - started, step
        self._writer = threading.Thread(target=self._write, args=(step, kept, staging, list(metrics)),
                                        name=f"rlhf-interim-write-{step}", daemon=True)
        self._writer.start()

    def _write(self, step: int, kept: dict[str, Any], staging: str, metrics: list[dict[str, float]]) -> None:
        from rlhf_core.rank.snapshot import write_state

        started = time.perf_counter()
        step_dir = os.path.join(self.folder, f"step_{step}")
        try:
            files = {relative: _write_file(step_dir, relative, functools.partial(write_state, state))
                     for relative, state in kept.items()}
            for relative in _files_under(staging):  # what DeepSpeed wrote itself (its recovery script)
                with open(os.path.join(staging, relative), "rb") as source:
                    files[relative] = _write_file(step_dir, relative, functools.partial(_copy_from, source))
            marker = {"step": step, "files": files, "metrics": metrics if self.rank == 0 else [],
                      "interval": self.interval}
            encoded = json.dumps(marker).encode()
            _write_file(step_dir, os.path.basename(_marker(step_dir, self.rank)),
                        functools.partial(_copy_from, io.BytesIO(encoded)))
            self._prune(keep_through=step)
        except BaseException as error:  # noqa: BLE001 - a failed snapshot is not used; training goes on
            self.write_error = error
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._buffers = kept
        self.write_seconds = time.perf_counter() - started
        self._choose_interval()

    def _choose_interval(self) -> None:
        """K: the fewest steps whose training covers the last copy and write, so the next snapshot never waits
        for this one (every step when a step is longer than both)."""
        if self.plan.every_steps or not self._step_seconds:
            return
        step_s = statistics.median(self._step_seconds)
        self.interval = max(1, math.ceil((self.copy_seconds + self.write_seconds) / max(step_s, 1e-6)))

    def finish(self) -> None:
        """Wait for the write in flight (a group's clean end)."""
        if self._writer is not None:
            self._writer.join()

    def _prune(self, keep_through: int) -> None:
        """This rank's files of all but its `KEEP` newest snapshots up to `keep_through` removed; a step folder
        no rank has a marker in any more goes whole (with what a dead writer left half-written)."""
        mine = sorted(step for step in map(_step_of, glob.glob(os.path.join(self.folder, "step_*")))
                      if 0 <= step <= keep_through and os.path.exists(_marker(self._dir(step), self.rank)))
        for step in mine[:-KEEP]:
            self._forget(step)

    def restore_from(self, step: int) -> None:
        """A new group starts from `step`: what this rank's predecessor wrote past it is forgotten (a newer
        snapshot of the failed group, whole or not, would otherwise count as this rank's newest)."""
        self.last_step = step
        for later in map(_step_of, glob.glob(os.path.join(self.folder, "step_*"))):
            if later > step:
                self._forget(later)

    def _dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step_{step}")

    def _forget(self, step: int) -> None:
        step_dir = self._dir(step)
        marker = _read_marker(step_dir, self.rank)
        for relative in (marker or {}).get("files", {}):
            _remove(os.path.join(step_dir, relative))
        _remove(_marker(step_dir, self.rank))
        if not glob.glob(os.path.join(step_dir, "rank*.json")):
            shutil.rmtree(step_dir, ignore_errors=True)


def _write_file(step_dir: str, relative: str, write: Callable[[BinaryIO], Any]) -> int:
    """Write one file (`write(handle)`) under a temporary name and rename it into place; returns its size."""
    path = os.path.join(step_dir, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as handle:
        write(handle)
    os.replace(partial, path)
    return os.path.getsize(path)


def _copy_from(source: BinaryIO, target: BinaryIO) -> None:
    shutil.copyfileobj(source, target)


def _files_under(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(parent, name), folder)
            for parent, _, names in os.walk(folder) for name in names]


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
