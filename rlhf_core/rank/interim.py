"""One rank's snapshots between commits: every K steps (at a boundary every rank agreed on) the rank's DeepSpeed
state, with the step and controller state it carries and the metrics since the last commit, is copied into a slot
in its node's tmpfs (`rlhf_core.storage.interim` has the slots' format), and K follows what a copy costs. Not in
OpenRLHF, whose ranks go back to the last `save_steps` checkpoint. docs/design-notes.md ("Snapshots between
commits") has why the copy is a stall here and how K is chosen.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rlhf_core.rank.snapshot import state_dicts_handed_to
from rlhf_core.storage.interim import (PREFIX, STALL_BUDGET, InterimPlan, SlotFiles, close_slot, copy_small_files,
                                       forget_after, interim_root, materialize, older_slot, open_slot)

_STEP_TIMES_KEPT = 16


@dataclass
class InterimSnapshots:
    """One rank's snapshots between commits (`folder`: its node's). `due` says whether this rank is ready for one
    at a step boundary (the ranks agree before any takes one: DeepSpeed's save is a collective), `take` copies the
    state into a slot, `restore_from` forgets what a failed group wrote past the step a new group starts from."""

    plan: InterimPlan
    rank: int
    folder: str
    last_step: int = 0  # the step of the last snapshot taken, or the one the rank started from
    interval: int = 1  # K: steps between two snapshots
    stall_seconds: float = 0.0  # the last snapshot's: training waits for all of it
    refused: bool = False  # tmpfs refused a snapshot (full): no more
    _step_seconds: list[float] = field(default_factory=list)
    _files: SlotFiles = field(default_factory=SlotFiles)

    def __post_init__(self) -> None:
        self.interval = self.plan.every_steps or 1

    def step_done(self, seconds: float) -> None:
        self._step_seconds = [*self._step_seconds[-_STEP_TIMES_KEPT + 1:], seconds]

    def median_step_seconds(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None

    def due(self, step: int) -> bool:
        """Whether this rank would take a snapshot at `step`: K steps since the last one (never after its tmpfs
        refused one)."""
        return not self.refused and step - self.last_step >= self.interval

    def take(self, step: int, engines: Iterable[Any], save: Callable[[str], None],
             metrics: list[dict[str, float]]) -> None:
        """Copy the state of `step` into the older slot (`save` writes it into a folder, as DeepSpeed would; its
        state dicts go into the slot instead). `metrics`: the steps' since the last commit. When tmpfs refuses it
        (full), this rank takes no more, so no rank does (they agree on each one) and the run goes on with its
        commits, with one warning."""
        from rlhf_core.notices import warn_once

        try:
            self._take(step, engines, save, metrics)
        except OSError as error:
            self.refused = True
            warn_once(f"rank {self.rank} takes no more snapshots between commits: {self.folder} refused one "
                      f"({error}); a lost rank goes back to the last commit. Give /dev/shm room (docker "
                      "--shm-size) or pass --snapshot_steps -1.", key="interim-refused")

    def _take(self, step: int, engines: Iterable[Any], save: Callable[[str], None],
              metrics: list[dict[str, float]]) -> None:
        started = time.perf_counter()
        slot = older_slot(self.folder, self.rank)
        open_slot(slot, self.rank)
        staging = tempfile.mkdtemp(prefix=f"{PREFIX}staging-{os.getpid()}-")
        try:
            files: dict[str, int] = {}
            with state_dicts_handed_to(engines, staging,
                                       lambda relative, state: files.update(self._files.store(slot, relative, state))):
                save(staging)
            files.update(copy_small_files(staging, slot))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        close_slot(slot, self.rank, {"step": step, "files": files, "metrics": metrics if self.rank == 0 else [],
                                     "interval": self.interval})
        self.last_step, self.stall_seconds = step, time.perf_counter() - started
        self._choose_interval()

    def _choose_interval(self) -> None:
        """K: the fewest steps over which one snapshot's stall is at most STALL_BUDGET of the training time
        (every step when a step takes 20 times a snapshot)."""
        step_s = self.median_step_seconds()
        if self.plan.every_steps or step_s is None:
            return
        self.interval = max(1, math.ceil(self.stall_seconds / (STALL_BUDGET * max(step_s, 1e-6))))

    def load(self, step: int, trainer: Any) -> int:
        """Load the snapshot of `step` into `trainer` (a DeepSpeedTrainer): DeepSpeed's files rebuilt from every
        rank's slot on this node (those this rank reads) into tmpfs, then loaded as a commit's; returns the step."""
        from rlhf_core.rank.loading import files_for_rank

        rebuilt = tempfile.mkdtemp(prefix=f"{PREFIX}restore-{os.getpid()}-", dir=interim_root())
        try:
            materialize(self.folder, step, self.plan.world_size, rebuilt,
                        lambda paths: files_for_rank(paths, self.rank, all_shards=False))
            loaded = trainer.load(rebuilt, False, False)
        finally:
            shutil.rmtree(rebuilt, ignore_errors=True)
        self.restore_from(loaded)
        return loaded

    def restore_from(self, step: int) -> None:
        """A new group starts from `step`: what this rank's predecessor wrote past it is forgotten (a newer
        snapshot of the failed group, whole or not, would otherwise count as this rank's newest)."""
        self.last_step = step
        forget_after(self.folder, self.rank, step)

