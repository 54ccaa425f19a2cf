"""The signals between a trainer and the rank hosting it (`RankSignals`, `WorkerSignals`), and the rank's progress
the driver's hang watch reads (`Progress`); light, so the rank's host imports it before torch."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


class RankSignals:
    """What a trainer tells the rank hosting it, and asks it, in the middle of a step (`rlhf_core.rank.worker`
    gives each trainer its own): a piece of long work done (an evaluation batch, a generation batch), which is the
    hang watch's progress and the driver's progress line, and whether every rank has agreed to stop (Ctrl-C or
    SIGTERM in the driver). These defaults are a trainer's outside a rank (tests, tools): nobody listens."""

    def work_done(self, phase: str, done: int, total: int) -> None:
        """`done` of the `total` pieces of `phase` ("eval", "generate") are done on this rank."""

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop, agreed by every rank (a collective: every rank must ask together)."""
        return False


class Progress:
    """What the driver's hang watch reads (`TrainWorker.heartbeat`, rlhf_core.driver.hang): a count that moves at
    every step and at the end of every other piece of work, the pieces in progress, and the slowest step."""

    def __init__(self) -> None:
        self.count, self.slowest_step_s = 0, 0.0
        self._busy: dict[str, int] = {}
        self._pieces: dict[str, tuple[int, int]] = {}  # long work inside a step: (done, total) by phase

    def report(self) -> tuple[int, tuple[str, ...], float, dict[str, tuple[int, int]]]:
        return (self.count, tuple(name for name, num in list(self._busy.items()) if num), self.slowest_step_s,
                dict(self._pieces))

    def piece_done(self, phase: str, done: int, total: int) -> None:
        """A piece of long work inside a step (an evaluation or generation batch) is progress too."""
        self.count += 1
        if done >= total:
            self._pieces.pop(phase, None)
        else:
            self._pieces[phase] = (done, total)

    @contextlib.contextmanager
    def working_on(self, phase: str) -> Iterator[None]:
        self._busy[phase] = self._busy.get(phase, 0) + 1
        try:
            yield
        finally:
            self._busy[phase] -= 1
            self.count += 1

    def step_done(self, seconds: float) -> None:
        self.count += 1
        self.slowest_step_s = max(self.slowest_step_s, seconds)


class WorkerSignals(RankSignals):
    """A trainer's signals inside a rank: its pieces of work move the rank's `Progress`, and it may ask whether
    every rank agrees to stop (`any_rank_asked_to_stop`, the rank's collective)."""

    def __init__(self, progress: Progress, any_rank_asked_to_stop: Callable[[], bool]) -> None:
        self._progress, self._any_rank_asked_to_stop = progress, any_rank_asked_to_stop

    def work_done(self, phase: str, done: int, total: int) -> None:
        self._progress.piece_done(phase, done, total)

    def stop_agreed(self) -> bool:
        return self._any_rank_asked_to_stop()
