"""The goodput ledger's categories (`Category`: where a stage's wall time went, each a field of its record in
goodput.json) and the chunk's timers (`Timer`: the keys of `ChunkResult.seconds`), with the one rule that maps
timers to categories (`category_shares`), and what a committed chunk reports (`CommittedChunk`).
`rlhf_core.ops.goodput` records them; `goodput_summary` reads them. docs/design-notes.md ("Goodput") defines each category.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Category(StrEnum):
    """A category of a stage's time; its value is the field's name in the ledger's JSON."""

    USEFUL = "useful_s"
    EVAL = "eval_s"  # evaluations inside the ranks' step loop, taken out of useful
    STALL = "stall_s"
    STARTUP = "startup_s"
    LOAD = "load_s"
    PLAN = "plan_s"
    LOST = "lost_s"
    COMMIT = "commit_s"  # runs in the background, beside training: not part of the wall time
    OUTAGE = "outage_s"  # store outages waited out: inside stall and other, no work lost


# The categories that are parts of the wall time; what they leave of it is "other".
WALL_CATEGORIES = (Category.USEFUL, Category.EVAL, Category.STALL, Category.STARTUP, Category.LOAD, Category.PLAN,
                   Category.LOST)


class Timer(StrEnum):
    """A timer of a chunk (`ChunkResult.seconds`' keys)."""

    STEP_LOOP = "step_loop"  # the ranks' own time in their step loop for the chunk's steps
    TRAIN = "train"  # the driver's wait for the ranks: shorter when they trained ahead during the last commit
    STALL = "stall"
    SAVE_AND_COMMIT = "save_and_commit"
    COMMIT = "commit"
    WORKERS = "workers"
    LOAD = "load"
    WORKERS_AND_LOAD = "workers_and_load"
    PLAN = "plan"
    WRITER_SLOWDOWN = "writer_slowdown"
    EVAL = "eval"


TIMER_CATEGORY: dict[Timer, Category] = {
    Timer.STEP_LOOP: Category.USEFUL, Timer.TRAIN: Category.USEFUL, Timer.STALL: Category.STALL,
    Timer.SAVE_AND_COMMIT: Category.STALL, Timer.COMMIT: Category.COMMIT, Timer.WORKERS: Category.STARTUP,
    Timer.LOAD: Category.LOAD, Timer.WORKERS_AND_LOAD: Category.LOAD, Timer.PLAN: Category.PLAN,
    Timer.WRITER_SLOWDOWN: Category.STALL, Timer.EVAL: Category.EVAL,
}
# With "stall" present, "save_and_commit" is not the stall (the asynchronous writer does the rest): it is left to
# "other" by subtraction. With "step_loop" present, "train" is not the useful time.
OVERRIDDEN_BY: dict[Timer, Timer] = {Timer.SAVE_AND_COMMIT: Timer.STALL, Timer.TRAIN: Timer.STEP_LOOP}
# Timers that are a part of another timer's time, taken out of that timer's category: the step loop's slowdown
# beside the background writer, and evaluation, are inside "step_loop" (or "train") but are not useful time.
PART_OF: dict[Timer, Category] = {Timer.WRITER_SLOWDOWN: Category.USEFUL, Timer.EVAL: Category.USEFUL}


def category_shares(seconds: Mapping[str, float]) -> list[tuple[Category, float]]:
    """What a chunk's timers add to each category, in the timers' order (a timer's time, and minus the parts
    other timers take out of it); an unknown timer adds nothing."""
    shares: list[tuple[Category, float]] = []
    for name, value in seconds.items():
        try:
            timer = Timer(name)
        except ValueError:
            continue
        if OVERRIDDEN_BY.get(timer) not in seconds:
            shares.append((TIMER_CATEGORY[timer], float(value)))
        if timer in PART_OF:
            shares.append((PART_OF[timer], -float(value)))
    return shares


@dataclass(frozen=True)
class CommittedChunk:
    """A chunk of `stage` that committed at `step`: its timers (ChunkResult.seconds), its step count (None: the
    pending chunk's), and how long the ranks have been training the next chunk ahead."""

    stage: str
    step: int
    seconds: Mapping[str, float]
    num_steps: int | None = None
    trained_ahead_s: float = 0.0
