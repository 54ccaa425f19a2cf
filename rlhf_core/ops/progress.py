"""The live progress bar of a stage on a terminal: the flow's chunk line (`sft [#####-----] 4/8 chunks  step 32/64: ...`,
flows/stage_report.py) redrawn in place at each chunk and each logged step. The console (`rlhf_core.ops.console`)
owns the bar and decides when one is drawn; see its docstring."""

from __future__ import annotations

import os
import re
import threading
from typing import Any, TextIO


# The flow's chunk line (flows/stage_report.progress_line): `sft [#####-----] 4/8 chunks  step 32/64: ...`.
CHUNK_LINE = re.compile(r"^(?P<stage>\S+) \[[#-]+\] (?P<done>\d+)/(?P<chunks>\d+) chunks  "
                        r"step (?P<step>\d+)/(?P<total>\d+)(?P<tail>.*)$")


LIVE_BAR_WIDTH = 30


_STEP_METRICS = ("reward", "loss")  # the first one a step reports is shown beside the bar


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def render_live_bar(stage: str, step: int, total_steps: int, chunks: str = "", tail: str = "",
                    width: int = LIVE_BAR_WIDTH) -> str:
    """`sft [###############---------------] 4/8 chunks  step 32/64  loss 2.97`: the bar follows the steps
    (so it moves between chunk commits too); `chunks` is the last chunk line's count, `tail` the rest."""
    filled = min(width, round(width * step / max(total_steps, 1)))
    counts = f" {chunks} chunks  " if chunks else " "
    return f"{stage} [{'#' * filled}{'-' * (width - filled)}]{counts}step {step}/{total_steps}{tail}"


class LiveBar:
    """The current stage's bar on a terminal, redrawn in place (carriage return, erase to the end of the line)
    and cut to the terminal's width, since a wrapped line cannot be redrawn. `is_open` while the cursor sits
    at the end of the bar: whatever prints next must first end its line (`end_line`)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.stage: str | None = None
        self.chunks = ""  # "4/8" from the stage's last chunk line
        self.is_open = False
        self._lock = threading.RLock()

    def draw_chunk_line(self, message: str) -> bool:
        """Draw a chunk line as the bar; False (nothing drawn) when `message` is not one."""
        match = CHUNK_LINE.match(message)
        if match is None:
            return False
        stage = match["stage"]
        with self._lock:
            self._switch_to(stage)
            self.chunks = f"{match['done']}/{match['chunks']}"
            step, total = int(match["step"]), int(match["total"])
            self._draw(render_live_bar(stage, step, total, self.chunks, match["tail"]))
            if step >= total:  # the stage's last chunk: the bar stays as its final line
                self.end_line()
        return True

    def draw_step(self, stage: str, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
        """Move the bar to a step logged inside a chunk, with the step's headline metric."""
        name = next((name for name in _STEP_METRICS if isinstance(metrics.get(name), (int, float))), None)
        tail = f"  {name} {metrics[name]:.4g}" if name else ""
        with self._lock:
            self._switch_to(stage)
            self._draw(render_live_bar(stage, step, total_steps, self.chunks, tail))

    def draw_work(self, stage: str, what: str, done: int, total: int) -> None:
        """Draw long work inside a step as the bar: `rm evaluating [#####-----] 12000/100000`."""
        filled = min(LIVE_BAR_WIDTH, round(LIVE_BAR_WIDTH * done / max(total, 1)))
        with self._lock:
            self._switch_to(stage)
            self._draw(f"{stage} {what} [{'#' * filled}{'-' * (LIVE_BAR_WIDTH - filled)}] {done}/{total}")

    def _switch_to(self, stage: str) -> None:
        if stage != self.stage:
            self.end_line()
            self.stage, self.chunks = stage, ""

    def _draw(self, text: str) -> None:
        import shutil

        columns = shutil.get_terminal_size().columns
        self.stream.write("\r" + text[:max(columns - 1, 20)] + "\x1b[K")
        self.stream.flush()
        self.is_open = True

    def end_line(self) -> None:
        with self._lock:
            if self.is_open:
                self.stream.write("\n")
                self.stream.flush()
                self.is_open = False
