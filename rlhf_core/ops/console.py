"""A quiet console for `rlhf train`, `rlhf run` and `rlhf demo`, with everything kept in the run's log file
(`rlhf_core.ops.run_log`): our chunk and stage lines, each warning once, errors from anyone and Ray's
autoscaler events stay on the console; Ray actors' output, the raylet's lines (a dead worker's ten lines: the
run says it in one), library loggers, FutureWarnings and Prefect's per-task lines go to the file only (`--verbose` shows everything). On a terminal the chunk line is a live bar.
docs/design-notes.md ("The quiet console") says how each source is kept off the console, and why that way.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import re
import sys
import threading
import warnings
from rlhf_core.ops.progress import LiveBar, is_terminal
from rlhf_core.ops.run_log import RunLogHandler
from dataclasses import dataclass, field
from typing import Any, TypeGuard

WARNING_PREFIX = "rlhf: warning: "  # how rlhf_core's warnings read on the console (ranks' and alerts)
WORKER_OUTPUT_LOGGER = "ray.worker_output"
# Libraries whose driver-side logs are for the log file; only their errors reach the console.
LIBRARY_LOGGERS = ("ray", "DeepSpeed", "transformers")
_QUIET_WARNING_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
_PREFECT_NOISE = re.compile(r"^(Starting|Stopping) temporary server on |^Finished in state (Completed|Cached)\(")
# A run stopped by a signal (rlhf_core.driver.stop.StoppedBySignal): its sentence is the CLI's last line, and the
# Cancelled states of its task, subflow and flow runs (the task's logged as an error) would repeat it three times.
_STOP_CANCELLED = re.compile(r"^Finished in state Cancelled\('stopped by ")


@dataclass
class Console:
    """What `configure_console` set up: the log file, verbosity, the live bar and the warnings shown. Logging is
    the process's, so the console lives where logging keeps its set-up: its file handler on the root logger
    (`current_console`), with no copy of its own here."""

    verbose: bool
    file_handler: RunLogHandler
    live_bar: LiveBar | None = None  # on a terminal, unless verbose
    warnings_shown: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def first_time(self, key: Any) -> bool:
        with self.lock:
            if key in self.warnings_shown:
                return False
            self.warnings_shown.add(key)
            return True


def current_console() -> Console | None:
    """The quiet console installed on the root logger by `configure_console`; None when there is none."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogHandler) and isinstance(handler.owner, Console):
            return handler.owner
    return None


def configured_log_file() -> str | None:
    """The log file of this process's quiet console, or None when `configure_console` was not called."""
    console = current_console()
    return console.file_handler.path if console else None


def open_log_file() -> None:
    """Start writing the log file (with what was held so far) and say where it is; idempotent."""
    console = current_console()
    if console is not None and console.file_handler.open():
        logging.getLogger(__name__).info("full log (Ray actors, DeepSpeed, Prefect) in %s",
                                         console.file_handler.path)


def discard_log_file() -> None:
    """The run was refused before it started: write no log file."""
    console = current_console()
    if console is not None and not console.file_handler.is_open:
        console.file_handler.discard()


class _LibraryConsoleFilter(logging.Filter):
    """On a library's own console handler: errors only (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        console = current_console()
        shown = console is None or console.verbose or record.levelno >= logging.ERROR
        if shown:
            end_live_line()
        return shown


class _CopyToFileThenGate(logging.Filter):
    """A logger filter for a logger that handles its records itself (DeepSpeed): every record goes to the log
    file, and only errors go on to the logger's own console handler (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        console = current_console()
        if console is None:
            return True
        console.file_handler.handle(record)
        shown = console.verbose or record.levelno >= logging.ERROR
        if shown:
            end_live_line()
        return shown


class _OwnLineFormatter(logging.Formatter):
    """A console handler's formatter, except for `rlhf_core`'s lines already spelled for the console (`rlhf:
    warning: ...`), which are written as they are, as the CLI writes its notes and errors."""

    def __init__(self, original: logging.Formatter | None):
        super().__init__()
        self.original, self.inner = original, original or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name.startswith("rlhf_core") and message.startswith(WARNING_PREFIX):
            return message
        return self.inner.format(record)


class _RootConsoleFilter(logging.Filter):
    """On the root logger's console handler (Prefect's): no temporary-server or task "Finished" lines, no
    Cancelled states of a stop (the CLI says it once), each warning once, chunk lines drawn as the live bar on a
    terminal, the rest as is (after ending the bar's line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        console = current_console()
        if console is None or console.verbose:
            return True
        if record.name.startswith("prefect.") and _STOP_CANCELLED.search(record.getMessage()):
            return False
        if record.levelno < logging.WARNING:
            message = record.getMessage()
            if _PREFECT_NOISE.search(message):
                return False
            if console.live_bar is not None:
                if not hasattr(record, "rlhf_on_live_bar"):  # drawn once, whatever the number of handlers
                    setattr(record, "rlhf_on_live_bar", console.live_bar.draw_chunk_line(message))
                if getattr(record, "rlhf_on_live_bar"):
                    return False
        if logging.WARNING <= record.levelno < logging.ERROR:
            # Decided once per record: with several console handlers, the second must not see a repeat.
            if not hasattr(record, "rlhf_first_time"):
                setattr(record, "rlhf_first_time", console.first_time((record.name, record.getMessage())))
            if not getattr(record, "rlhf_first_time"):
                return False
        end_live_line()
        return True


def _add_once(target: logging.Logger | logging.Handler, item: logging.Filter | logging.Handler) -> None:
    """Add a filter to `target` unless one of its class is there, or a handler to a logger unless it is there."""
    if isinstance(item, logging.Filter):
        if not any(type(existing) is type(item) for existing in target.filters):
            target.addFilter(item)
    elif not isinstance(target, logging.Logger):
        raise TypeError(f"a handler is added to a logger, not to {target!r}")
    elif not any(existing is item for existing in target.handlers):
        target.addHandler(item)


_CONSOLE_FILTERS = (_LibraryConsoleFilter, _CopyToFileThenGate, _RootConsoleFilter)
_ORIGINAL_SHOWWARNING = warnings.showwarning


def _is_console_handler(handler: logging.Handler) -> TypeGuard[logging.StreamHandler]:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def gate_library_logger(name: str, file_handler: RunLogHandler) -> None:
    """The library logger `name` writes to `file_handler` too, and its console handlers show errors only."""
    library_logger = logging.getLogger(name)
    for handler in library_logger.handlers:
        if _is_console_handler(handler):
            _add_once(handler, _LibraryConsoleFilter())
    if library_logger.propagate is False:  # otherwise the root logger's file handler gets its records
        _add_once(library_logger, file_handler)


def _gate_transformers(transformers_logging) -> None:
    """transformers' own handler made now, then gated as Ray's is; no progress bars unless verbose."""
    console = current_console()
    transformers_logging.get_logger()  # creates transformers' handler
    if console is None:
        return
    if not console.verbose:
        transformers_logging.disable_progress_bar()
    gate_library_logger("transformers", console.file_handler)


class _AfterImport(importlib.abc.MetaPathFinder):
    """On sys.meta_path until `name` is imported: runs `then(module)` right after the module's own code."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module, then = spec.loader.exec_module, self.then

            def exec_then(module) -> None:
                exec_module(module)
                then(module)
            spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def after_import(name: str, then) -> None:
    """`then(module)` once `name` is imported: now if it is, else right after its import (once, whoever asks twice)."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def configure_console(log_file: str, verbose: bool = False, live_progress: bool | None = None) -> str:
    """Send everything to `log_file` and keep the console to our own lines, warnings once and errors (all of
    it on the console too when `verbose`). Call once Prefect has configured logging (importing prefect does);
    returns the log file's path. The file is written from when `open_log_file()` is called (preflight passed).
    `live_progress`: draw the chunk lines as live bars (default: when the root logger's console handler
    writes to a terminal; never when verbose, where other programs' lines would cut through the bar).
    """
    file_handler = RunLogHandler(log_file)
    previous = current_console()
    if previous is not None:  # configured again in this process (tests): the old file is let go everywhere
        for name in ("", *LIBRARY_LOGGERS):
            logging.getLogger(name).removeHandler(previous.file_handler)
        previous.file_handler.close()
    root = logging.getLogger()
    console_handlers = [handler for handler in root.handlers if _is_console_handler(handler)]
    streams = [handler.stream for handler in console_handlers]
    terminal = next((stream for stream in streams if is_terminal(stream)), None)
    if live_progress is None:
        live_progress = terminal is not None
    bar_stream = terminal or (streams[0] if streams else sys.stderr)
    file_handler.owner = Console(verbose, file_handler,
                                 LiveBar(bar_stream) if live_progress and not verbose else None)
    for handler in console_handlers:
        _add_once(handler, _RootConsoleFilter())
        if not isinstance(handler.formatter, _OwnLineFormatter):
            handler.setFormatter(_OwnLineFormatter(handler.formatter))
    root.addHandler(file_handler)
    _add_once(logging.getLogger("DeepSpeed"), _CopyToFileThenGate())  # before deepspeed is imported
    import ray  # noqa: F401 - creates Ray's logger and its console handler, to be gated now

    # transformers (~1 CPU-s to import) is gated when something imports it: a driver whose data is prepared never does
    after_import("transformers.utils.logging", _gate_transformers)
    gate_library_logger("ray", file_handler)
    warnings.showwarning = _show_warning
    logging.getLogger(__name__).setLevel(logging.INFO)  # the line saying where the log file is
    return log_file


def reset_console() -> None:
    """Undo `configure_console` in this process (tests): filters, the file handler, `warnings.showwarning`."""
    console = current_console()
    if console is None:
        return
    end_live_line()
    for name in ("", *LIBRARY_LOGGERS):
        library_logger = logging.getLogger(name)
        library_logger.removeHandler(console.file_handler)
        for target in (library_logger, *library_logger.handlers):
            for installed in [f for f in target.filters if isinstance(f, _CONSOLE_FILTERS)]:
                target.removeFilter(installed)
        for handler in library_logger.handlers:
            if isinstance(handler.formatter, _OwnLineFormatter):
                handler.setFormatter(handler.formatter.original)
    console.file_handler.close()
    warnings.showwarning = _ORIGINAL_SHOWWARNING
    if not console.verbose:
        import transformers.utils.logging as transformers_logging

        transformers_logging.enable_progress_bar()
    dispatcher = stdstream_dispatcher()
    if dispatcher is not None:
        dispatcher.remove_handler("rlhf_log_file")  # rlhf_core.ops.ray_output's
    console.file_handler.owner = None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` while the console is configured: always to the log file; on the console once
    per message, and not at all for FutureWarning/DeprecationWarning (unless verbose)."""
    console = current_console()
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    if console is None:
        sys.stderr.write(text + "\n")
        return
    record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None)
    console.file_handler.handle(record)
    quiet = issubclass(category, _QUIET_WARNING_CATEGORIES)
    if console.verbose or (not quiet and console.first_time((category.__name__, str(message)))):
        end_live_line()
        (file or sys.stderr).write(text + "\n")


# ----------------------------------------------------------------------------------------- progress bars


def end_live_line() -> None:
    """Before a line of its own reaches the console: end the live bar's line, if one is drawn."""
    console = current_console()
    if console is not None and console.live_bar is not None:
        console.live_bar.end_line()


def live_progress() -> bool:
    """Whether a live bar is drawn (a terminal is watching): then the chunk's training loop may stop at each
    logged step to move it (`show_step`); otherwise a chunk need not stop before its end for the console."""
    console = current_console()
    return console is not None and console.live_bar is not None


def show_step(stage: str, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
    """A step logged inside a chunk (rlhf_core.driver.chunk's training loop): moves the live bar on a terminal;
    nothing otherwise (the chunk line says it at the chunk's end)."""
    console = current_console()
    if console is not None and console.live_bar is not None:
        console.live_bar.draw_step(stage, step, total_steps, metrics)


WORK_LINE_EVERY_S = 10.0  # without a terminal, long work inside a step is logged this often
_WORK_NAMES = {"eval": "evaluating", "generate": "generating"}  # the long work inside a step shown as its own bar
_last_work_line: dict[tuple[str, str], float] = {}


def show_work(stage: str, phase: str, done: int, total: int) -> None:
    """Long work inside a step (an evaluation of 100,000 pairs, a rollout): a bar on a terminal, else an INFO line
    every WORK_LINE_EVERY_S in the run's log (`rm: evaluating 12000/100000 (12%)`)."""
    import time

    what = _WORK_NAMES.get(phase)
    if what is None:  # a step's own micro-batches ("train", "score"): the step bar says enough
        return
    console = current_console()
    if console is not None and console.live_bar is not None:
        console.live_bar.draw_work(stage, what, done, total)
        return
    now = time.monotonic()
    if now - _last_work_line.get((stage, phase), float("-inf")) >= WORK_LINE_EVERY_S:
        _last_work_line[(stage, phase)] = now
        logging.getLogger("rlhf_core.progress").info(
            "%s: %s %d/%d (%.0f%%)", stage, what, done, total, 100.0 * done / max(total, 1))


# Each rank prints rlhf_core's own warnings (a flag with no effect here, a fallback) with this prefix
# (`rank_warnings`), so quiet mode can show them on the console, once each, among the actors' output.
RANK_WARNING_PREFIX = WARNING_PREFIX


def rank_warnings() -> None:
    """In a rank (a Ray actor): rlhf_core's warnings go to stderr as `rlhf: warning: <message>`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(RANK_WARNING_PREFIX + "%(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("rlhf_core").addHandler(handler)


def stdstream_dispatcher():
    """Ray's hook for the actors' output that reaches the driver (private API; None when absent)."""
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    needed = ("add_handler", "remove_handler")
    return global_worker_stdstream_dispatcher if all(hasattr(global_worker_stdstream_dispatcher, name)
                                                     for name in needed) else None
