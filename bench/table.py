"""The suite's ratios and its final table: each measure, its reference (TRL, or the copy it is held
against), ours, the ratio, the goal from issue 10, and whether the goal is met.

Pure arithmetic and formatting, no measuring, so a unit test can check it (tests/unit/test_bench_table.py).
A ratio is always ours / reference. A goal reads "ratio <= bound" for costs (seconds per step, stall,
overhead) and "ratio >= bound" for throughputs (samples per second). A measure that did not run, or
whose reference is zero, shows "n/a" and counts as neither met nor missed. A row without a goal
(goal None) is a measure shown for context (e.g. another checksum's cost): its ratio, no verdict.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    measure: str
    reference: float | None  # TRL's number, or the copy of the same bytes
    ours: float | None
    unit: str  # "s", "samples/s", ...
    goal_op: str  # "<=" or ">="
    goal: float | None  # None: shown for context, no verdict
    as_percent: bool = False  # show the ratio (and the goal) as a percentage

    @property
    def ratio(self) -> float | None:
        if self.reference is None or self.ours is None or self.reference == 0:
            return None
        return self.ours / self.reference

    @property
    def met(self) -> bool | None:
        ratio = self.ratio
        if ratio is None or self.goal is None:
            return None
        return ratio <= self.goal if self.goal_op == "<=" else ratio >= self.goal

    def cells(self) -> list[str]:
        ratio, met = self.ratio, self.met
        return [self.measure, _value(self.reference, self.unit), _value(self.ours, self.unit),
                "n/a" if ratio is None else _share(ratio, self.as_percent),
                "-" if self.goal is None else f"{self.goal_op} {_share(self.goal, self.as_percent)}",
                "-" if self.goal is None else "n/a" if met is None else ("yes" if met else "NO")]


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


def _share(ratio: float, as_percent: bool) -> str:
    return f"{100 * ratio:.1f}%" if as_percent else f"{ratio:.2f}x"


HEADER = ["measure", "TRL / reference", "ours", "ratio", "goal", "met?"]


def format_table(rows: list[Row]) -> str:
    """A Markdown table, columns padded so it also reads as plain text."""
    lines = [HEADER] + [row.cells() for row in rows]
    widths = [max(len(line[column]) for line in lines) for column in range(len(HEADER))]
    text = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(text)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def outside_per_chunk(chunk_ends: list[float], loop_seconds: list[float]) -> list[float]:
    """Seconds of each warm chunk (the second on) that the ranks spent outside their step loop: the time
    from the end of one chunk's training to the end of the next one's, less the next one's step loop.
    With asynchronous checkpoints the ranks train a chunk while the previous one commits, so the driver's
    view of when training ran says nothing; the period and the ranks' own loop time still do."""
    return [(later - earlier) - loop for earlier, later, loop in zip(chunk_ends, chunk_ends[1:], loop_seconds[1:])]


def extra_per_checkpoint(wall_chunked: float, wall_single: float, checkpoints_chunked: int,
                         checkpoints_single: int) -> float | None:
    """Wall seconds each extra checkpoint added to a run: the same run with more checkpoints, less the run
    with fewer, over the difference in their number (None when they wrote as many)."""
    extra = checkpoints_chunked - checkpoints_single
    return (wall_chunked - wall_single) / extra if extra > 0 else None
