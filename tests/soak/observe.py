"""What the soak reads to see a fault and the recovery from it, all after the fact except the live ranks:
the ranks' fault trace (RLHF_FAULT_TRACE: `time pid train_step@N stage`, and each rank's `setup@0` and `loaded@N`
marks), the run's log (its WARNING lines), the flow run's Prefect states, and the committed checkpoints of the
store."""

from __future__ import annotations

import posixpath
import re
import time
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from flows.restarts import RESTARTING
from rlhf_core.processes import process_exists

REPLACED = re.compile(r"Replaced the ranks in ([\d.]+) s")
FROM_SNAPSHOT = re.compile(r"a snapshot between commits, taken every (\d+) steps?")
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+)\s+(\S+) - (.*)$")


@dataclass(frozen=True)
class Step:
    """A rank starting training step `step` of `stage` at `time` (time.time())."""

    time: float
    pid: int
    step: int
    stage: str


@dataclass(frozen=True)
class Mark:
    """A rank reaching `point` at `time`: "setup" (its trainer's set-up begins) or "loaded" (checkpoint `step` loaded)."""

    time: float
    pid: int
    point: str
    step: int


MARKS = ("setup", "loaded")


def _text(path: Path) -> str:
    """The file's text; none while it does not exist yet."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def read_trace(path: Path) -> list[Step]:
    return _steps(_text(path))


class Trace:
    """The trace read as it grows: each `read` parses only the whole lines added since the last (the soak looks
    several times a second at a file of tens of thousands of lines)."""

    def __init__(self, path: Path):
        self.path, self.steps, self.marks, self._offset = path, [], [], 0

    def read(self) -> list[Step]:
        try:
            with open(self.path, "rb") as trace:
                trace.seek(self._offset)
                added = trace.read()
        except FileNotFoundError:
            return self.steps
        whole = added[:added.rfind(b"\n") + 1]
        self._offset += len(whole)
        self.steps += _steps(whole.decode(errors="replace"))
        self.marks += _marks(whole.decode(errors="replace"))
        return self.steps


def _steps(text: str) -> list[Step]:
    steps = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].startswith("train_step@"):
            steps.append(Step(float(parts[0]), int(parts[1]), int(parts[2].split("@")[1]), parts[3]))
    return steps


def _marks(text: str) -> list[Mark]:
    marks = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].partition("@")[0] in MARKS:
            point, _, step = parts[2].partition("@")
            marks.append(Mark(float(parts[0]), int(parts[1]), point, int(step)))
    return marks


def is_stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def live_rank_pids(steps: list[Step], within_s: float = 10.0) -> list[int]:
    """The ranks that started a step in the last `within_s` seconds and still run (not stopped), by pid."""
    now = time.time()
    pids = {step.pid for step in reversed(steps) if now - step.time < within_s}
    return sorted(pid for pid in pids if process_exists(pid) and not is_stopped(pid))


def training_now(steps: list[Step], within_s: float = 5.0) -> bool:
    return bool(steps) and time.time() - steps[-1].time < within_s


@dataclass(frozen=True)
class LogLine:
    time: float
    level: str
    message: str


def read_log(path: Path) -> list[LogLine]:
    """The run log's records (rlhf_core.ops.run_log's format), continuation lines dropped."""
    lines = []
    for line in _text(path).splitlines():
        match = LOG_LINE.match(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append(LogLine(stamp, match.group(2), match.group(4)))
    return lines


CONSOLE_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| (\w+)\s*\| (\S+) - (.*)$")


def read_console(path: Path, since: float) -> list[LogLine]:
    """Records from Prefect's console format (`23:56:43.041 | WARNING | logger - message`, a worker's log, which
    carries its flow runs' output) dated on or after `since` (time.time()): the line has the time of day only."""
    text = _text(path)
    day = datetime.fromtimestamp(since).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    lines = []
    for line in text.splitlines():
        match = CONSOLE_LINE.match(line)
        if match:
            hours, minutes, seconds = match.group(1).split(":")
            stamp = day + int(hours) * 3600 + int(minutes) * 60 + float(seconds)
            stamp += 86400 if stamp < since - 3600 else 0  # past midnight
            if stamp >= since:
                lines.append(LogLine(stamp, match.group(2), match.group(4)))
    return lines


def committed_steps(store_url: str, run_name: str, stage: str, **storage_options) -> list[int]:
    """The committed steps of `stage` in the store now."""
    from rlhf_core.storage.checkpoint import CheckpointStore

    store = CheckpointStore(posixpath.join(store_url, run_name, stage), storage_options)
    return [info.step for info in store.list() if info.is_committed]


@dataclass
class Evidence:
    """Everything the soak saw of one run, to time each fault after it."""

    steps: list[Step]
    log: list[LogLine]
    states: list[tuple[float, str, str]]  # (time, type, name) of each Prefect state of the flow run
    worker_restarts: list[float]
    marks: list[Mark] = field(default_factory=list)

    def detected_at(self, kind: str, injected_at: float, until: float = float("inf")) -> float | None:
        """When the pipeline (or, for the worker, its supervisor) first acted on a fault of `kind`, seen before
        `until` (the next fault); None when nothing says so (a power cut can take a log's last lines with it)."""
        after = [line for line in self.log if injected_at <= line.time < until]
        if kind in ("rank_kill", "rank_hang", "oom", "node_loss"):
            for line in after:
                match = REPLACED.search(line.message)
                if match:  # the line is written when the new ranks are ready; it says how long that took
                    return line.time - float(match.group(1))
            return None
        if kind == "flow_run_kill":  # its supervisor's restart (flows/supervise.py), else the worker's report
            return self._state_after(injected_at, until,
                                     lambda type_, name: type_ == "CRASHED" or name == RESTARTING)
        if kind == "power_cut":
            return self._state_after(injected_at, until, lambda type_, name: type_ == "CRASHED")
        if kind == "preemption":
            return self._state_after(injected_at, until, lambda type_, name: name == "Preempted")
        if kind == "worker_kill":
            return next((stamp for stamp in self.worker_restarts if stamp >= injected_at), None)
        if kind == "store_outage":
            return next((line.time for line in after if "store is unreachable" in line.message), None)
        warnings = [line.time for line in after if line.level in ("WARNING", "ERROR")]
        return min(warnings, default=self._state_after(injected_at, until, lambda type_, _: type_ != "RUNNING"))

    def snapshot_interval(self, injected_at: float, until: float = float("inf")) -> int | None:
        """K of the snapshot between commits the ranks replaced after the fault started from (None: they started
        from a commit, or no ranks were replaced in place)."""
        for line in self.log:
            if injected_at <= line.time < until and REPLACED.search(line.message):
                found = FROM_SNAPSHOT.search(line.message)
                return int(found.group(1)) if found else None
        return None

    def crashed_between(self, since: float, until: float) -> bool:
        return self._state_after(since, until, lambda type_, _: type_ == "CRASHED") is not None

    def _state_after(self, since: float, until: float, matches) -> float | None:
        return next((stamp for stamp, type_, name in self.states if since <= stamp < until and matches(type_, name)),
                    None)

    def next_step(self, after: float, new_ranks_only: bool) -> Step | None:
        """The first step started after `after`; with `new_ranks_only`, by a process that had not trained before,
        or by one that set up again since (a dead driver's ranks train on until they stop, then serve the run's
        next attempt as spares)."""
        old = {step.pid for step in self.steps if step.time <= after} if new_ranks_only else set()
        set_up_again: dict[int, float] = {}
        for mark in self.marks:
            if mark.point == "setup" and mark.time > after:
                set_up_again.setdefault(mark.pid, mark.time)
        return next((step for step in self.steps if step.time > after and (
            step.pid not in old or step.time > set_up_again.get(step.pid, float("inf")))), None)

    def last_step_before(self, moment: float) -> Step | None:
        started = [step for step in self.steps if step.time < moment]
        return max(started, key=lambda step: step.time) if started else None

    def rank_start(self, pid: int, after: float) -> tuple[float | None, float | None]:
        """When rank `pid` began its set-up after `after`, and when it had then loaded a checkpoint (None: not seen;
        a rank starting a stage from its model loads none)."""
        setup = next((mark.time for mark in self.marks if mark.pid == pid and mark.point == "setup"
                      and mark.time > after), None)
        if setup is None:
            return None, None
        loaded = next((mark.time for mark in self.marks if mark.pid == pid and mark.point == "loaded"
                       and mark.time > setup), None)
        return setup, loaded

    def step_seconds(self, before: float) -> float | None:
        """The median time from one step to the next of the same rank and stage, over the steps before `before`."""
        last: dict[tuple[int, str], Step] = {}
        gaps = []
        for step in (step for step in self.steps if step.time < before):
            previous = last.get((step.pid, step.stage))
            if previous is not None and step.step == previous.step + 1:
                gaps.append(step.time - previous.time)
            last[(step.pid, step.stage)] = step
        return statistics.median(gaps) if gaps else None
