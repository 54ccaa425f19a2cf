"""The suite's ratios and its final table: each measure, its reference (TRL, or the copy it is held
against), ours, the ratio, the goal from issue 10, and whether the goal is met.

Pure arithmetic and formatting, no measuring, so a unit test can check it (tests/unit/test_bench_table.py).
A ratio is always ours / reference. A goal reads "ratio <= bound" for costs (seconds per step, stall,
overhead) and "ratio >= bound" for throughputs (samples per second). A measure that did not run, or
whose reference is zero, shows "n/a" and counts as neither met nor missed.
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
    goal: float
    as_percent: bool = False  # show the ratio (and the goal) as a percentage

    @property
    def ratio(self) -> float | None:
        if self.reference is None or self.ours is None or self.reference == 0:
            return None
        return self.ours / self.reference

    @property
    def met(self) -> bool | None:
        ratio = self.ratio
        if ratio is None:
            return None
        return ratio <= self.goal if self.goal_op == "<=" else ratio >= self.goal

    def cells(self) -> list[str]:
        ratio, met = self.ratio, self.met
        return [self.measure, _value(self.reference, self.unit), _value(self.ours, self.unit),
                "n/a" if ratio is None else _share(ratio, self.as_percent),
                f"{self.goal_op} {_share(self.goal, self.as_percent)}",
                "n/a" if met is None else ("yes" if met else "NO")]


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


def window_means(timestamps: list[float], window: int, skip: int) -> list[float]:
    """Mean seconds per step over consecutive windows of `window` steps, from the end times of steps
    1..N (`timestamps[i]` = end of step i+1), skipping the first `skip` steps (warm-up). Window k covers
    steps skip+k*window+1 .. skip+(k+1)*window and is measured end to end, so it includes everything
    between steps, as a chunk's train timer does."""
    means = []
    start = skip
    while start + window <= len(timestamps) and start > 0:
        means.append((timestamps[start + window - 1] - timestamps[start - 1]) / window)
        start += window
    return means


def boundary_gaps(spans: list[tuple[float, float]]) -> list[float]:
    """Seconds between the end of one training span and the start of the next: the time a warm chunk
    boundary spends outside training (spans are (start, end) of consecutive train calls)."""
    return [following[0] - previous[1] for previous, following in zip(spans, spans[1:])]
