"""A run's goodput read from its ledger (`rlhf_core.ops.goodput`): per stage and in total, as text (`rlhf goodput`)
and markdown (the stage report); and the checkpoint-interval planner (`plan_interval`, after Young and Daly).
docs/design-notes.md ("The checkpoint-interval planner") has the formula.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from rlhf_core.errors import UserError
from rlhf_core.ops.goodput import CRASHED, GOODPUT_FILE_NAME, RUNNING, GoodputLedger
from rlhf_core.ops.goodput_categories import WALL_CATEGORIES


@dataclass
class StageGoodput:
    stage: str
    wall_s: float = 0.0
    useful_s: float = 0.0
    eval_s: float = 0.0  # evaluations inside the ranks' step loop, not in useful
    stall_s: float = 0.0
    commit_s: float = 0.0
    startup_s: float = 0.0
    load_s: float = 0.0
    plan_s: float = 0.0
    lost_s: float = 0.0
    outage_s: float = 0.0  # store outages waited out: inside stall and other, no work lost
    chunks: int = 0
    steps: int = 0
    lost_chunks: int = 0
    lost_steps: int = 0
    attempts: int = 0
    lost_to: dict[str, float] = field(default_factory=dict)  # lost_s by cause: "hangs", "lost ranks"...

    @property
    def other_s(self) -> float:
        """Wall time no timer accounts for: Prefect between chunks, export, teardown."""
        return self.wall_s - sum(getattr(self, name) for name in WALL_CATEGORIES)

    @property
    def goodput(self) -> float | None:
        return self.useful_s / self.wall_s if self.wall_s > 0 else None

    @property
    def step_seconds(self) -> float | None:
        return self.useful_s / self.steps if self.steps else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "other_s": self.other_s, "goodput": self.goodput, "step_seconds": self.step_seconds}


@dataclass
class GoodputSummary:
    stages: list[StageGoodput]
    total: StageGoodput
    down_s: float = 0.0
    num_attempts: int = 0
    num_crashed: int = 0
    running: bool = False
    pending: list[dict] = field(default_factory=list)
    num_replacements: int = 0  # in-place replacements of the ranks (rlhf_core.driver.runner.Replacement)
    recovery_s: list[float] = field(default_factory=list)  # the newest ones': from the loss to training again

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [stage.to_dict() for stage in self.stages], "total": self.total.to_dict(),
                "down_s": self.down_s, "attempts": self.num_attempts, "crashed": self.num_crashed,
                "running": self.running, "pending": self.pending, "replacements": self.num_replacements,
                "recovery_s": self.recovery_s}


def summarize(doc: Mapping[str, Any]) -> GoodputSummary:
    """Per-stage and total figures of a ledger document."""
    stages = []
    for name, record in doc.get("stages", {}).items():
        stages.append(StageGoodput(name, **{key: record.get(key, 0) for key in StageGoodput.__dataclass_fields__
                                            if key not in ("stage", "lost_to")},
                               lost_to=dict(record.get("lost_to", {}))))
    total = StageGoodput("total")
    for stage in stages:
        for key in StageGoodput.__dataclass_fields__:
            if key not in ("stage", "lost_to"):
                setattr(total, key, getattr(total, key) + getattr(stage, key))
        for cause, seconds in stage.lost_to.items():
            total.lost_to[cause] = total.lost_to.get(cause, 0.0) + seconds
    total.wall_s += doc.get("outside_stages_s", 0.0)
    attempts = doc.get("attempts", [])
    total.attempts = len(attempts)
    records = doc.get("stages", {}).values()
    return GoodputSummary(stages, total, doc.get("down_s", 0.0), len(attempts),
                          sum(attempt["state"] == CRASHED for attempt in attempts),
                          any(attempt["state"] == RUNNING for attempt in attempts), list(doc.get("pending", [])),
                          sum(record.get("num_replacements", 0) for record in records),
                          [entry["recovery_s"] for record in records for entry in record.get("replacements", [])])


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    return f"{value / 60:.1f} min" if value >= 600 else f"{value:.1f} s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_summary(summary: GoodputSummary, run_url: str) -> str:
    """A few lines: the run's goodput, then one line per stage and a total line."""
    total = summary.total
    lines = [f"goodput {_percent(total.goodput)} of run {run_url}: {_seconds(total.useful_s)} of committed "
             f"training in {_seconds(total.wall_s)} wall, {summary.num_attempts} attempt(s), "
             f"{summary.num_crashed} crashed" + (f", {_seconds(summary.down_s)} down between attempts (not counted)"
                                                 if summary.down_s >= 0.05 else "")
             + (" (an attempt is running or ended without a word)" if summary.running else "")]
    header = f"{'stage':<6} {'goodput':>7} {'steps':>6} {'chunks':>6} {'useful':>9} {'stall':>8} {'start-up':>9} " \
             f"{'load':>8} {'lost':>14} {'other':>8} {'commit*':>8}"
    lines.append(header)
    for row in (*summary.stages, total):
        lost = f"{_seconds(row.lost_s)}/{row.lost_steps}st"
        lines.append(f"{row.stage:<6} {_percent(row.goodput):>7} {row.steps:>6} {row.chunks:>6} "
                     f"{_seconds(row.useful_s):>9} {_seconds(row.stall_s):>8} {_seconds(row.startup_s):>9} "
                     f"{_seconds(row.load_s):>8} {lost:>14} {_seconds(row.other_s):>8} {_seconds(row.commit_s):>8}")
    for cause, seconds in sorted(total.lost_to.items()):
        lines.append(f"lost to {cause}: {_seconds(seconds)}")
    if total.eval_s:
        lines.append(f"evaluation: {_seconds(total.eval_s)} (" + ", ".join(
            f"{row.stage} {_seconds(row.eval_s)}" for row in summary.stages if row.eval_s) + "; not in useful)")
    if total.outage_s:
        lines.append(f"lost to store outages: {_seconds(total.outage_s)} waited out (in stall and other; training "
                     "went on from the snapshot, nothing committed was lost)")
    if summary.num_replacements:
        recoveries = sorted(summary.recovery_s)
        lines.append(f"ranks replaced in place: {summary.num_replacements} time(s); from the loss to training again "
                     f"median {_seconds(recoveries[len(recoveries) // 2])}, worst {_seconds(recoveries[-1])}")
    lines.append("useful: train seconds of committed chunks; lost: chunks never committed (time/steps); other: "
                 "Prefect, planning, export; *commit runs in the background, beside training")
    return "\n".join(lines)


def format_markdown(summary: GoodputSummary, run_url: str) -> str:
    """The same figures as a markdown table, for the Prefect artifact."""
    rows = ["| stage | goodput | steps | chunks | useful | stall | start-up | load | lost (s / steps) | other | "
            "commit (background) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in (*summary.stages, summary.total):
        rows.append(f"| {row.stage} | {_percent(row.goodput)} | {row.steps} | {row.chunks} | {row.useful_s:.1f} s | "
                    f"{row.stall_s:.1f} s | {row.startup_s:.1f} s | {row.load_s:.1f} s | {row.lost_s:.1f} s / "
                    f"{row.lost_steps} | {row.other_s:.1f} s | {row.commit_s:.1f} s |")
    return "\n".join([f"# Goodput of {run_url}", "",
                      f"**{_percent(summary.total.goodput)}**: {summary.total.useful_s:.1f} s of committed training in "
                      f"{summary.total.wall_s:.1f} s wall; {summary.num_attempts} attempt(s), {summary.num_crashed} "
                      f"crashed, {summary.down_s:.1f} s down between attempts (not counted).", "", *rows, "",
                      f"From `{GOODPUT_FILE_NAME}` in the run folder (`rlhf goodput {run_url}`)."])


def read_ledger(run_url: str, storage_options: Mapping[str, Any] | None = None) -> GoodputSummary:
    """The summary of a run's ledger; a UserError (one sentence) when `run_url` has none."""
    ledger = GoodputLedger(run_url, storage_options)
    try:
        if not ledger.fs.isdir(ledger.root):
            raise UserError(f"{run_url} is not a folder; give a run folder {{ckpt_path}}/{{run_name}} "
                            "(e.g. ./ckpt/rlhf).")
        if not ledger.exists():
            from rlhf_core.stages import STAGES

            parent, _, name = run_url.rstrip("/").rpartition("/")
            hint = f" ({name} is a stage folder: give its parent, {parent})" if name in STAGES else ""
            raise UserError(f"{run_url} has no {GOODPUT_FILE_NAME}: give a run folder {{ckpt_path}}/{{run_name}} "
                            f"that has trained at least one chunk{hint}.")
        return summarize(ledger.read())
    except ValueError as error:
        raise UserError(f"{ledger.url} is not a goodput ledger ({error}); it is written by rlhf training runs only.") \
            from None
    except OSError as error:
        raise UserError(f"cannot read {ledger.url}: {error}.") from None


@dataclass
class IntervalPlan:
    checkpoint_seconds: float  # C: what each checkpoint costs the step loop
    step_seconds: float
    restart_seconds: float  # R: start-up and load after a failure
    mtbf_seconds: float
    interval_seconds: float  # Young's T = sqrt(2 C M), seconds of work between checkpoints
    save_steps: int
    expected_goodput: float  # at save_steps, first order


def expected_goodput(interval_seconds: float, checkpoint_seconds: float, mtbf_seconds: float,
                     restart_seconds: float = 0.0) -> float:
    """First-order goodput with a checkpoint every `interval_seconds` of work: 1 - C/T - (T/2 + R)/M."""
    if interval_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("the interval and the MTBF must be positive")
    return 1.0 - checkpoint_seconds / interval_seconds - (interval_seconds / 2 + restart_seconds) / mtbf_seconds


def plan_interval(checkpoint_seconds: float, step_seconds: float, mtbf_seconds: float,
                  restart_seconds: float = 0.0) -> IntervalPlan:
    """Young's interval T = sqrt(2 C M) in steps (at least 1), and the goodput expected at that many steps."""
    if checkpoint_seconds < 0 or step_seconds <= 0 or mtbf_seconds <= 0 or restart_seconds < 0:
        raise ValueError("checkpoint and restart seconds must be >= 0; step seconds and the MTBF > 0")
    interval = math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
    save_steps = max(1, round(interval / step_seconds))
    return IntervalPlan(checkpoint_seconds, step_seconds, restart_seconds, mtbf_seconds, interval, save_steps,
                        expected_goodput(save_steps * step_seconds, checkpoint_seconds, mtbf_seconds, restart_seconds))


def measured_costs(stage: StageGoodput) -> tuple[float, float, float] | None:
    """(C, step seconds, R) measured in a stage's ledger, or None before it committed a chunk. C is what each
    chunk boundary costs the step loop: its stall plus the chunk's share of planning and of the time between
    chunks ("other"); R is start-up plus load per attempt."""
    if not stage.chunks or not stage.steps or stage.useful_s <= 0:
        return None
    boundary = (stage.stall_s + stage.plan_s + max(0.0, stage.other_s)) / stage.chunks
    restart = (stage.startup_s + stage.load_s) / max(stage.attempts, 1)
    return boundary, stage.useful_s / stage.steps, restart
