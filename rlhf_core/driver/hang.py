"""Hang detection: every wait on the ranks has a progress deadline. Each rank counts its progress (a step, a piece of
long work inside one: a micro-batch, an evaluation batch, a block of generated tokens; the end of a load, a
snapshot, a write); while the driver waits, it asks every rank for that count about once a second, on
the rank's control thread. A rank whose count has not moved for the deadline (`--hang_timeout_s`, by default
max(60 s, 5x the slowest step so far), and 900 s before its first step and during a write), or that no longer
answers (SIGSTOP, a dead mount in the kernel), is hung: its Python stacks are saved (py-spy) and the chunk
fails with `RankHung` (its step and frame in `where`), retried from the last commit; the same hang on every try
stops the run (`driver/repeats.py`). docs/design-notes.md ("Hangs") says why this way.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

MIN_HANG_S = 60.0
SLOWEST_STEP_FACTOR = 5.0
STARTUP_HANG_S = 900.0  # a load, a snapshot, a write or the first step: minutes on a 70B model
HEARTBEAT_S = 1.0
PY_SPY_TIMEOUT_S = 30.0
STEADY_PHASES = frozenset({"train"})  # the phases whose deadline follows the measured step time


@dataclass
class RankProgress:
    """What the driver knows of one rank's progress: its count, busy phases, slowest step, and when it moved."""

    count: int = -1
    phases: tuple[str, ...] = ()
    slowest_step_s: float = 0.0
    moved_at: float = 0.0
    answered_at: float = 0.0
    asking: Any = None  # the heartbeat in flight (an ObjectRef)
    pieces: dict[str, tuple[int, int]] = field(default_factory=dict)  # long work in a step: (done, total) by phase
    steps_done: int = 0  # the last step the rank finished

    @property
    def step(self) -> int:
        """The step the rank is at: the one it trains while training, else the last it finished (being saved)."""
        return self.steps_done + 1 if "train" in self.phases else self.steps_done


@dataclass(frozen=True)
class HungRank:
    rank: int
    stalled_s: float
    phases: tuple[str, ...]  # as the rank last said
    deadline_s: float
    answering: bool  # whether it still answers heartbeats (a rank waiting in a collective) or not (stopped)
    step: int = 0  # the step it was at (`RankProgress.step`)

    def describe(self) -> str:
        """`made no progress for ...`, for the hang's sentence."""
        doing = f"{', '.join(self.phases) or 'starting'}; " if self.answering else "not answering; "
        return f"made no progress for {self.stalled_s:.0f} s ({doing}--hang_timeout_s {self.deadline_s:g})"


def deadline_s(progress: RankProgress, timeout_s: float | None, slowest_step_s: float = 0.0) -> float:
    """How long `progress` may stand still (`slowest_step_s`: the slowest step the driver has seen come back).
    Before the rank's first step (imports, a JIT build, set-up, the load): the start-up window, or the user's
    timeout if longer. After it: the user's timeout; else the steady deadline while only steps are in flight, and
    the start-up window while a snapshot or a write is (a large upload)."""
    slowest = max(progress.slowest_step_s, slowest_step_s)
    if slowest <= 0:
        return max(STARTUP_HANG_S, timeout_s or 0.0)
    if timeout_s:
        return timeout_s
    steady = set(progress.phases) <= STEADY_PHASES
    return max(MIN_HANG_S, SLOWEST_STEP_FACTOR * slowest) if steady else STARTUP_HANG_S


@dataclass
class HangWatch:
    """The driver's watch over a worker group's progress while it waits on the ranks (`poll` from the wait)."""

    workers: list
    timeout_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    ranks: list[RankProgress] = field(default_factory=list)
    slowest_step_s: float = 0.0  # of the steps that came back to the driver (a rank may stop before it tells)
    _last_poll: float = 0.0

    def __post_init__(self) -> None:
        self.ranks = [RankProgress() for _ in self.workers]

    def steps_returned(self, step_seconds: list[float], reached: int = 0) -> None:
        """Steps the ranks reported with their results, up to step `reached`: the steady deadline holds from then
        on, and a rank that stops before its next heartbeat is named at least at `reached`, not at 0."""
        self.slowest_step_s = max([self.slowest_step_s, *step_seconds])
        for progress in self.ranks:
            progress.steps_done = max(progress.steps_done, reached)

    def restart(self) -> None:
        """A new wait begins: the time each rank stood still before it (the driver was busy) does not count."""
        now = self.clock()
        for progress in self.ranks:
            progress.moved_at = progress.answered_at = now

    def poll(self) -> HungRank | None:
        """Collect the heartbeats that came back and ask again (at most every HEARTBEAT_S); the first rank past
        its deadline, or None."""
        now = self.clock()
        if now - self._last_poll < HEARTBEAT_S:
            return None
        self._last_poll = now
        for worker, progress in zip(self.workers, self.ranks):
            if progress.asking is not None:
                ready, _ = ray.wait([progress.asking], timeout=0)
                if not ready:
                    continue  # no answer yet: a stopped process answers nothing, and its count stands still
                self._take(progress, progress.asking, now)
            progress.asking = worker.heartbeat.remote()
        allowed = [deadline_s(progress, self.timeout_s, self.slowest_step_s) for progress in self.ranks]
        late = [rank for rank, progress in enumerate(self.ranks) if now - progress.moved_at > allowed[rank]]
        if not late:
            return None
        # The ranks that wait in a collective for a stopped one still answer: blame the one that does not.
        rank = min(late, key=lambda late_rank: self.ranks[late_rank].answered_at)
        progress = self.ranks[rank]
        return HungRank(rank, now - progress.moved_at, progress.phases, allowed[rank],
                        answering=now - progress.answered_at <= 3 * HEARTBEAT_S, step=progress.step)

    @staticmethod
    def _take(progress: RankProgress, answer: Any, now: float) -> None:
        progress.asking, progress.answered_at = None, now
        try:
            count, phases, slowest_step_s, pieces, steps_done = ray.get(answer)
        except ray.exceptions.RayError:
            return  # the rank is gone: the wait itself reports that (WorkerLost)
        if count != progress.count:
            progress.count, progress.moved_at = count, now
        progress.phases, progress.slowest_step_s, progress.pieces = tuple(phases), slowest_step_s, dict(pieces)
        progress.steps_done = steps_done

    def step_of(self, rank: int) -> int:
        """The step `rank` was at when it last answered (a lost rank's step, for `WorkerLost`)."""
        return self.ranks[rank].step if 0 <= rank < len(self.ranks) else 0

    def pieces(self) -> dict[str, tuple[int, int]]:
        """The long work inside the step under way, as the first rank last told it: (done, total) by phase."""
        return dict(self.ranks[0].pieces) if self.ranks else {}


# --------------------------------------------------------------------------- the stacks of a hung group

FRAME = re.compile(r"^\s+(\S+) \((\S+:\d+)\)\s*$")


def py_spy_dump(pid: int) -> str:
    """`py-spy dump` of a local process (it reads a stopped process's memory too); its error when it cannot."""
    binary = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        done = subprocess.run([binary, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"py-spy dump --pid {pid} failed: {error}"
    return done.stdout if done.returncode == 0 else f"py-spy dump --pid {pid} failed: {done.stderr.strip()}"


def stuck_frame(dump: str) -> str | None:
    """The innermost frame of our own code in a py-spy dump, the training thread's first, skipping the threads that
    serve the driver (the heartbeat, Ray's own): `function (file:line)`."""
    threads = [[match.groups() for match in map(FRAME.match, thread.splitlines()) if match]
               for thread in re.split(r"\n(?=Thread )", dump)]
    threads = [frames for frames in threads if not any(name.endswith("heartbeat") for name, _ in frames)]
    # The training thread first: in a stopped process every thread stands still, the uploader's too.
    threads.sort(key=lambda frames: not any(name.endswith("train_until") for name, _ in frames))
    for frames in threads:
        ours = [(name, where) for name, where in frames if "rlhf_core" in where]
        if ours:
            name, where = ours[0]
            return f"{name} ({where.split('rlhf_core/')[-1]})"
    return None


def dump_rank_stacks(location: Any) -> str:
    """The stacks of the rank at `location` (a RankLocation): py-spy here when it runs on this node, else from a
    task placed on its node."""
    if location.node_ip == ray.util.get_node_ip_address():
        return py_spy_dump(location.pid)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_dump = ray.remote(num_cpus=0)(py_spy_dump).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(location.node_id, soft=False))
    try:
        return ray.get(remote_dump.remote(location.pid), timeout=PY_SPY_TIMEOUT_S + 10)
    except (ray.exceptions.RayError, TimeoutError) as error:
        return f"py-spy on node {location.node_ip} failed: {error}"


def save_stacks(path: str, rank_dumps: dict[int, str]) -> None:
    """Every rank's stacks and the driver's threads into `path` (best effort: a hang report must not fail)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as out:
            for rank, dump in rank_dumps.items():
                out.write(f"==== rank {rank} ====\n{dump}\n")
            out.write("==== the driver's threads ====\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
    except OSError:
        pass
