"""A failure that comes back on new ranks at the same place is not cured by more of them (`ChunkTries`): a hang at
the same step in the same frame, or a rank lost at the same step (a deterministic OOM kill), after every
replacement a chunk allows, stops the run with one sentence (`StallRepeats`, which no Prefect retry and no restart
of a deployment's run takes up). docs/design-notes.md ("Hangs") says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlhf_core.errors import FailedAt, RankHung, StallRepeats, WorkerLost


@dataclass
class FailedTry:
    """One try of a chunk that failed on its ranks: where, and how long it ran (from its start to the failure)."""

    error: WorkerLost | RankHung
    seconds: float

    @property
    def place(self) -> tuple | None:
        """What must be equal on every try for the failure to be the same one: its kind, step and frame."""
        where = self.error.where
        return None if where is None else (type(self.error).__name__, where.step, where.frame)


@dataclass
class ChunkTries:
    """The failed tries of each chunk (stage, target step) in this process, and when the try under way began."""

    tries: dict[tuple[str, int], list[FailedTry]] = field(default_factory=dict)
    try_started_at: float = field(default_factory=time.monotonic)

    def try_starts(self) -> None:
        """A try of a chunk begins (its group is being made, or the warm one taken)."""
        self.try_started_at = time.monotonic()

    def failed(self, error: WorkerLost | RankHung, stage: str, target_step: int) -> int:
        """Record a failed try of the chunk; how many tries of it have failed."""
        tries = self.tries.setdefault((stage, target_step), [])
        tries.append(FailedTry(error, time.monotonic() - self.try_started_at))
        return len(tries)

    def repeated(self, stage: str, target_step: int, num_tries: int) -> StallRepeats | None:
        """The run's end when the chunk's last `num_tries` tries all failed at the same place, else None."""
        last = self.tries.get((stage, target_step), [])[-num_tries:]
        if len(last) < num_tries or last[0].place is None or any(each.place != last[0].place for each in last):
            return None
        return stall_repeats(stage, [each.seconds for each in last], last[-1].error)


def stall_repeats(stage: str, seconds: list[float], error: WorkerLost | RankHung) -> StallRepeats:
    """The one sentence: the step, the frame, how long each try ran, and what to raise or look at."""
    where: FailedAt = error.where  # type: ignore[assignment]  # `repeated` checked it
    ran = ", ".join(f"{each:.0f} s" for each in seconds)
    tries = f"{len(seconds)} tries in a row, each on new ranks (they ran {ran})"
    if isinstance(error, RankHung):
        stacks = f"; its stacks are in {error.stacks_path}" if error.stacks_path else ""
        return StallRepeats(
            f"{stage} stalled at step {where.step} in {where.frame or 'a frame py-spy could not read'} on {tries}: new "
            f"ranks, retries and restarts do not cure it, so the run stops here. If that work is only slow, raise "
            f"--hang_timeout_s above {where.deadline_s:g} s and run the same command again{stacks}.", error.alert)
    return StallRepeats(
        f"{stage}: rank {where.rank} was lost at step {where.step} on {tries}: new ranks, retries and restarts do not "
        f"cure it, so the run stops here. A rank killed at the same step every time is most often out of memory: "
        f"lower --micro_train_batch_size (or give the ranks more memory) and run the same command again.")
