"""One rank's snapshots between commits: every K steps (at a boundary every rank agreed on) the rank's DeepSpeed
state, with the step and controller state it carries and the metrics since the last commit, is copied into a slot
in its node's tmpfs (`rlhf_core.storage.interim` has the slots' format), then, in a thread beside the next steps,
to the keeper on the group's next node when it has several (`rlhf_core.storage.interim_copies`), and K follows
what both cost. Not in
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rlhf_core.rank.snapshot import state_dicts_handed_to
from rlhf_core.storage.interim import (PREFIX, STALL_BUDGET, InterimPlan, SlotFiles, close_slot, copy_small_files,
                                       forget_after, interim_root, materialize, older_slot, open_slot, read_slot,
                                       slot_holding)

# For a rank loading a snapshot: each rank's (marker, the keeper of the node holding it; None: this rank's node).
Sources = dict[int, tuple[dict, Any]]

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
    copy_seconds: float = 0.0  # the last copy's to the peer node, beside the steps after it
    refused: bool = False  # tmpfs refused a snapshot (full): no more
    _step_seconds: list[float] = field(default_factory=list)
    _files: SlotFiles = field(default_factory=SlotFiles)
    _copying: Future | None = None
    _copier: ThreadPoolExecutor | None = None

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
        self._wait_for_copy()  # the copy before reads a slot the snapshot after next writes over
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
        self._start_copy(step)
        self._choose_interval()

    def _start_copy(self, step: int) -> None:
        """Send the snapshot of `step` to the peer node's keeper, in a thread beside the next steps."""
        if self.plan.copy_to is None:
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="rlhf-interim-copy")
        self._copying = self._copier.submit(self._copy_to_peer, self.plan.copy_to, step)

    def _copy_to_peer(self, keeper: Any, step: int) -> None:
        import ray

        started = time.perf_counter()
        marker, files = read_slot(self.folder, self.rank, step)
        ray.get(keeper.store.remote(self.rank, marker, files))
        self.copy_seconds = time.perf_counter() - started

    def _wait_for_copy(self) -> None:
        copying, self._copying = self._copying, None
        if copying is None:
            return
        try:
            copying.result()
        except Exception as error:  # noqa: BLE001 - a copy lost with its peer node costs only what it covered
            from rlhf_core.notices import warn_once

            warn_once(f"rank {self.rank}'s snapshot between commits of step {self.last_step} was not copied to its "
                      f"peer node ({type(error).__name__}: {error}); if this rank's node is lost, its ranks go back "
                      "to an older snapshot or the last commit.", key="interim-copy")

    def _choose_interval(self) -> None:
        """K: the fewest steps over which one snapshot's stall is at most STALL_BUDGET of the training time
        (every step when a step takes 20 times a snapshot), and over which the copy to the peer node keeps up."""
        step_s = self.median_step_seconds()
        if self.plan.every_steps or step_s is None:
            return
        step_s = max(step_s, 1e-6)
        self.interval = max(1, math.ceil(self.stall_seconds / (STALL_BUDGET * step_s)),
                            math.ceil(self.copy_seconds / step_s))

    def load(self, step: int, trainer: Any, sources: Sources) -> int:
        """Load the snapshot of `step` into `trainer` (a DeepSpeedTrainer): DeepSpeed's files (those this rank
        reads) rebuilt into tmpfs from every rank's slot, on this node or fetched from the keeper of the node that
        holds it (`sources`), then loaded as a commit's; returns the step."""
        from rlhf_core.rank.loading import files_for_rank

        def wanted(paths: list[str]) -> list[str]:
            return files_for_rank(paths, self.rank, all_shards=False)

        rebuilt = tempfile.mkdtemp(prefix=f"{PREFIX}restore-{os.getpid()}-", dir=interim_root())
        try:
            held = self._slots_of(step, sources, wanted, os.path.join(rebuilt, "fetched"))
            materialize(held, os.path.join(rebuilt, "state"), wanted)
            loaded = trainer.load(os.path.join(rebuilt, "state"), False, False)
        finally:
            shutil.rmtree(rebuilt, ignore_errors=True)
        self.restore_from(loaded)
        return loaded

    def _slots_of(self, step: int, sources: Sources, wanted: Callable[[list[str]], list[str]],
                  fetched: str) -> dict[int, tuple[str, dict]]:
        """Each rank's (slot, marker) of `step`: this node's slot, or the files this rank reads of a slot on
        another node, fetched through its keeper into `fetched`."""
        import ray

        states = [relative.removesuffix(".skel") for marker, _ in sources.values() for relative in marker["files"]
                  if relative.endswith(".skel")]
        needed = set(wanted(sorted(states)))
        held = {}
        for rank, (marker, keeper) in sources.items():
            if keeper is None:
                local = slot_holding(self.folder, rank, step)
                if local is None:
                    raise FileNotFoundError(f"rank {rank}'s snapshot of step {step} is no longer whole in {self.folder}")
                held[rank] = local
                continue
            # each state file this rank reads is two in the slot: its skeleton and its tensors' bytes
            names = [f"{state}{suffix}" for state in needed if f"{state}.skel" in marker["files"]
                     for suffix in (".skel", ".bin")]
            slot = os.path.join(fetched, f"rank{rank}")
            for name, data in ray.get(keeper.read.remote(rank, step, names)).items():
                os.makedirs(os.path.dirname(os.path.join(slot, name)), exist_ok=True)
                with open(os.path.join(slot, name), "wb") as handle:
                    handle.write(data)
            held[rank] = (slot, marker)
        return held

    def restore_from(self, step: int) -> None:
        """A new group starts from `step`: what this rank's predecessor wrote past it is forgotten (a newer
        snapshot of the failed group, whole or not, would otherwise count as this rank's newest)."""
        self.last_step = step
        forget_after(self.folder, self.rank, step)

