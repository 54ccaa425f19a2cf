"""A quiet console for `rlhf train`, `rlhf run` and `rlhf demo`, with everything kept in a log file.

Without it the console drowns the chunk lines in other programs' output: every line a Ray actor prints
(`(TrainWorker pid=...)`: DeepSpeed's "Setting accelerator to CPU", op builds, transformers' "Loading
weights" bars), Ray's own warnings, DeepSpeed's and transformers' loggers in the driver, library
FutureWarnings, and Prefect's temporary-server and per-task "Finished in state" lines.

`configure_console(log_file, verbose)` (called by the CLI once Prefect has set up its logging) keeps on
the console: our own lines (the flow run's chunk and stage lines, `rlhf_core` notices), each warning once,
errors from anyone, and Ray's raylet/autoscaler lines (an OOM kill, a dead node). Everything, shown or not,
is also written to the log file, with Ray actors' output under the logger name `ray.worker_output`.
A record of `rlhf_core` whose message is already a console line (`rlhf: warning: ...`: an alert, see
rlhf_core.ops.alerts) is printed as it is, without the console handler's time and logger name (`_OwnLineFormatter`);
the same record reaches the flow run's log through Prefect's API handler (PREFECT_LOGGING_EXTRA_LOGGERS).
With `verbose` (`--verbose`) the console shows everything as before and the file still gets it all.

One progress bar per stage: the flow logs one line per chunk (`sft [#####-----] 4/8 chunks  step 32/64: ...`,
flows/stage_report.py). When the console is a terminal (and not verbose), that line is drawn as a live bar
instead (`LiveBar`): rewritten in place with a carriage return at each chunk and at each logged step
(`show_step`, called by the chunk's training loop), and ended with a newline when the stage's last step is
reached or before any other line reaches the console, so nothing is written over. Not on a terminal (CI,
a worker's captured output, a pipe to a file), each chunk line stays a line of its own, as the log file
keeps it in every case.

Who calls `configure_console`: the CLI (`rlhf train`, `rlhf run`, `rlhf demo`), and the flow `rlhf` itself
when it runs from a deployment (a worker's flow-run process, flows/pipeline.py), which no CLI sets up.

Where the log file is (`log_file_for`): `{ckpt_path}/{run_name}/logs/driver.log` when the run folder is
local (beside the checkpoints and `alerts.jsonl`), appended to by each run of that run name. For a run
folder in an object store (s3://...) a file cannot be appended to as it grows, so the log goes to
`./rlhf-logs/{run_name}.log` in the current directory instead. The file is opened only once the run is real
(Ray starts, or the run ends other than by a UserError; records until then are held in memory), so a run
that preflight refuses writes nothing; its first line on the console says where it is.

How each source is kept off the console (and why this way):
- Ray actors' stdout/stderr: the driver receives them when `ray.init(log_to_driver=True)`; Ray hands each
  batch to the handlers of `ray._private.worker.global_worker_stdstream_dispatcher`. `route_ray_worker_output`
  (called by `rlhf_core.driver.engine.ensure_ray` right after `ray.init`) swaps Ray's printing handler for one that
  writes to the log file. Should that private hook be missing (another Ray version), or with a Ray client
  (`ray://`, whose worker output arrives by another path), `ray_init_options` asks for `log_to_driver=False`
  instead: then the actors' output stays only in Ray's session logs on each node,
  `/tmp/ray/session_latest/logs/worker-*.out` and `.err` (the driver log names the session folder).
- Ray's, DeepSpeed's and transformers' loggers in the driver: each has its own console handler and does not
  propagate. Ray's and transformers' handlers get a filter that lets errors through, and the loggers get the
  log file as a second handler. DeepSpeed creates its handler at import and warns in the same breath (the
  accelerator line), so its logger gets, before that import, a logger filter that copies each record to the
  file and lets only errors on. (`DS_ACCELERATOR=cpu` would silence that warning too, but it must not reach a
  GPU rank, so the environment is left alone.)
- Prefect's console handler (on the root logger): a filter drops the temporary-server lines and the task runs'
  "Finished in state Completed/Cached" lines (the flow's chunk line says the same), and repeats of a warning.
- Python warnings: `warnings.showwarning` writes each to the file; on the console FutureWarning and
  DeprecationWarning (library notices meant for developers) are left out and any other warning shows once.
- transformers' progress bars in the driver (the export's "Writing model shards") are turned off.

Nothing here imports prefect: the filters recognise Prefect's handler as "a stream handler on the root logger".
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from rlhf_core.storage.locate import local_path
from rlhf_core.ops.progress import LiveBar, is_terminal
from dataclasses import dataclass, field
from typing import Any

WARNING_PREFIX = "rlhf: warning: "  # how rlhf_core's warnings read on the console (ranks' and alerts)
LOG_DIR_NAME = "logs"
LOG_FILE_NAME = "driver.log"
REMOTE_FALLBACK_DIR = "rlhf-logs"
WORKER_OUTPUT_LOGGER = "ray.worker_output"
# Libraries whose driver-side logs are for the log file; only their errors reach the console.
LIBRARY_LOGGERS = ("ray", "DeepSpeed", "transformers")
_QUIET_WARNING_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
_PREFECT_NOISE = re.compile(r"^(Starting|Stopping) temporary server on |^Finished in state (Completed|Cached)\(")
_FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s - %(message)s"
_MAX_HELD_RECORDS = 100_000  # before the file opens (preflight's few records; a bound, not a budget)


def log_file_for(run_url: str, run_name: str) -> str:
    """Where `configure_console` writes for a run: in the run folder when it is local, else ./rlhf-logs."""
    local = local_path(run_url)
    if local is None:
        return os.path.abspath(os.path.join(REMOTE_FALLBACK_DIR, f"{run_name}.log"))
    return os.path.join(os.path.abspath(local), LOG_DIR_NAME, LOG_FILE_NAME)


class _FailSafeFileHandler(logging.FileHandler):
    """A FileHandler that, when its file cannot be written (a full disk, a lost mount), says so once on the
    console and stops writing, instead of printing logging's traceback for every record that follows."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            return super().handleError(record)
        if not self.failed:
            self.failed = True
            warn_log_file_lost(self.baseFilename, error)
        with contextlib.suppress(OSError):
            self.close()


def warn_log_file_lost(path: str, error: OSError) -> None:
    print(f"rlhf: warning: cannot write the run's log file {path} ({error.strerror or error}); the console "
          "keeps logging, the file stops here.", file=sys.__stderr__, flush=True)


class _RunLogHandler(logging.Handler):
    """The log file, opened only once the run is real: records are held in memory until `open()` (Ray starts,
    or the CLI sees the run end other than by a UserError), so a run refused by preflight writes nothing."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._held: list[logging.LogRecord] = []
        self._file: logging.FileHandler | None = None

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def open(self) -> bool:
        """Create the file and write what was held; True when this call opened it."""
        with self.lock:
            if self._file is not None:
                return False
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = _FailSafeFileHandler(self.path, encoding="utf-8")
            except OSError as error:  # the run goes on without its file
                self._file = _FailSafeFileHandler(os.devnull, encoding="utf-8")
                self._file.failed = True
                warn_log_file_lost(self.path, error)
            # Not self.formatter: ray.init(configure_logging=True) sets the format of every handler on the
            # "ray" logger, this one included.
            self._file.setFormatter(logging.Formatter(_FILE_FORMAT))
            for record in self._held:
                self._file.emit(record)
            self._held.clear()
            return True

    def discard(self) -> None:
        with self.lock:
            self._held.clear()

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is not None:
            if not self._file.failed:
                self._file.emit(record)
        elif len(self._held) < _MAX_HELD_RECORDS:
            self._held.append(record)

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
        super().close()


@dataclass
class _Console:
    """What `configure_console` set up in this process (one per process)."""

    verbose: bool
    file_handler: _RunLogHandler
    live_bar: LiveBar | None = None  # on a terminal, unless verbose
    warnings_shown: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def first_time(self, key: Any) -> bool:
        with self.lock:
            if key in self.warnings_shown:
                return False
            self.warnings_shown.add(key)
            return True


_console: _Console | None = None


def configured_log_file() -> str | None:
    """The log file of this process's quiet console, or None when `configure_console` was not called."""
    return _console.file_handler.path if _console else None


def open_log_file() -> None:
    """Start writing the log file (with what was held so far) and say where it is; idempotent."""
    if _console is not None and _console.file_handler.open():
        logging.getLogger(__name__).info("full log (Ray actors, DeepSpeed, Prefect) in %s",
                                         _console.file_handler.path)


def discard_log_file() -> None:
    """The run was refused before it started: write no log file."""
    if _console is not None and not _console.file_handler.is_open:
        _console.file_handler.discard()


class _LibraryConsoleFilter(logging.Filter):
    """On a library's own console handler: errors only (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        shown = _console is None or _console.verbose or record.levelno >= logging.ERROR
        if shown:
            end_live_line()
        return shown


class _CopyToFileThenGate(logging.Filter):
    """A logger filter for a logger that handles its records itself (DeepSpeed): every record goes to the log
    file, and only errors go on to the logger's own console handler (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _console is None:
            return True
        _console.file_handler.handle(record)
        shown = _console.verbose or record.levelno >= logging.ERROR
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
    """On the root logger's console handler (Prefect's): no temporary-server or task "Finished" lines, each
    warning once, chunk lines drawn as the live bar on a terminal, the rest as is (after ending the bar's line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _console is None or _console.verbose:
            return True
        if record.levelno < logging.WARNING:
            message = record.getMessage()
            if _PREFECT_NOISE.search(message):
                return False
            if _console.live_bar is not None:
                if not hasattr(record, "rlhf_on_live_bar"):  # drawn once, whatever the number of handlers
                    record.rlhf_on_live_bar = _console.live_bar.draw_chunk_line(message)
                if record.rlhf_on_live_bar:
                    return False
        if logging.WARNING <= record.levelno < logging.ERROR:
            # Decided once per record: with several console handlers, the second must not see a repeat.
            if not hasattr(record, "rlhf_first_time"):
                record.rlhf_first_time = _console.first_time((record.name, record.getMessage()))
            if not record.rlhf_first_time:
                return False
        end_live_line()
        return True


def _add_once(target: logging.Logger | logging.Handler, item: Any) -> None:
    present = target.filters if isinstance(item, logging.Filter) else getattr(target, "handlers", [])
    if not any(type(existing) is type(item) and (isinstance(item, logging.Filter) or existing is item)
               for existing in present):
        (target.addFilter if isinstance(item, logging.Filter) else target.addHandler)(item)


_CONSOLE_FILTERS = (_LibraryConsoleFilter, _CopyToFileThenGate, _RootConsoleFilter)
_ORIGINAL_SHOWWARNING = warnings.showwarning


def _is_console_handler(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def _gate_library_logger(name: str) -> None:
    """The library logger `name` writes to the log file too, and its console handlers show errors only."""
    library_logger = logging.getLogger(name)
    for handler in library_logger.handlers:
        if _is_console_handler(handler):
            _add_once(handler, _LibraryConsoleFilter())
    if library_logger.propagate is False:  # otherwise the root logger's file handler gets its records
        _add_once(library_logger, _console.file_handler)


def configure_console(log_file: str, verbose: bool = False, live_progress: bool | None = None) -> str:
    """Send everything to `log_file` and keep the console to our own lines, warnings once and errors (all of
    it on the console too when `verbose`). Call once Prefect has configured logging (importing prefect does);
    returns the log file's path. The file is written from when Ray starts or `open_log_file()` is called.
    `live_progress`: draw the chunk lines as live bars (default: when the root logger's console handler
    writes to a terminal; never when verbose, where other programs' lines would cut through the bar).
    """
    global _console
    file_handler = _RunLogHandler(log_file)
    if _console is not None:  # configured again in this process (tests): the old file is let go everywhere
        for name in ("", *LIBRARY_LOGGERS):
            logging.getLogger(name).removeHandler(_console.file_handler)
        _console.file_handler.close()
    root = logging.getLogger()
    console_handlers = [handler for handler in root.handlers if _is_console_handler(handler)]
    streams = [handler.stream for handler in console_handlers]
    terminal = next((stream for stream in streams if is_terminal(stream)), None)
    if live_progress is None:
        live_progress = terminal is not None
    bar_stream = terminal or (streams[0] if streams else sys.stderr)
    _console = _Console(verbose, file_handler, LiveBar(bar_stream) if live_progress and not verbose else None)
    for handler in console_handlers:
        _add_once(handler, _RootConsoleFilter())
        if not isinstance(handler.formatter, _OwnLineFormatter):
            handler.setFormatter(_OwnLineFormatter(handler.formatter))
    root.addHandler(file_handler)
    _add_once(logging.getLogger("DeepSpeed"), _CopyToFileThenGate())  # before deepspeed is imported
    import ray  # noqa: F401 - creates Ray's logger and its console handler, to be gated now
    import transformers.utils.logging as transformers_logging

    transformers_logging.get_logger()  # creates transformers' handler
    if not verbose:
        transformers_logging.disable_progress_bar()
    for name in LIBRARY_LOGGERS:
        if name != "DeepSpeed":
            _gate_library_logger(name)
    warnings.showwarning = _show_warning
    logging.getLogger(__name__).setLevel(logging.INFO)  # the line saying where the log file is
    return log_file


def reset_console() -> None:
    """Undo `configure_console` in this process (tests): filters, the file handler, `warnings.showwarning`."""
    global _console
    if _console is None:
        return
    end_live_line()
    for name in ("", *LIBRARY_LOGGERS):
        library_logger = logging.getLogger(name)
        library_logger.removeHandler(_console.file_handler)
        for target in (library_logger, *library_logger.handlers):
            for installed in [f for f in target.filters if isinstance(f, _CONSOLE_FILTERS)]:
                target.removeFilter(installed)
            if isinstance(getattr(target, "formatter", None), _OwnLineFormatter):
                target.setFormatter(target.formatter.original)
    _console.file_handler.close()
    warnings.showwarning = _ORIGINAL_SHOWWARNING
    if not _console.verbose:
        import transformers.utils.logging as transformers_logging

        transformers_logging.enable_progress_bar()
    dispatcher = _stdstream_dispatcher()
    if dispatcher is not None:
        dispatcher.remove_handler("rlhf_log_file")
    _console = None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` while the console is configured: always to the log file; on the console once
    per message, and not at all for FutureWarning/DeprecationWarning (unless verbose)."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    if _console is None:
        sys.stderr.write(text + "\n")
        return
    record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None)
    _console.file_handler.handle(record)
    quiet = issubclass(category, _QUIET_WARNING_CATEGORIES)
    if _console.verbose or (not quiet and _console.first_time((category.__name__, str(message)))):
        end_live_line()
        (file or sys.stderr).write(text + "\n")


# ----------------------------------------------------------------------------------------- progress bars


def end_live_line() -> None:
    """Before a line of its own reaches the console: end the live bar's line, if one is drawn."""
    if _console is not None and _console.live_bar is not None:
        _console.live_bar.end_line()


def live_progress() -> bool:
    """Whether a live bar is drawn (a terminal is watching): then the chunk's training loop may stop at each
    logged step to move it (`show_step`); otherwise a chunk need not stop before its end for the console."""
    return _console is not None and _console.live_bar is not None


def show_step(stage: str, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
    """A step logged inside a chunk (rlhf_core.driver.chunk's training loop): moves the live bar on a terminal;
    nothing otherwise (the chunk line says it at the chunk's end)."""
    if _console is not None and _console.live_bar is not None:
        _console.live_bar.draw_step(stage, step, total_steps, metrics)


# ----------------------------------------------------------------------------------------- Ray


def _stdstream_dispatcher():
    """Ray's hook for the actors' output that reaches the driver (private API; None when absent)."""
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    needed = ("add_handler", "remove_handler")
    return global_worker_stdstream_dispatcher if all(hasattr(global_worker_stdstream_dispatcher, name)
                                                     for name in needed) else None


def ray_init_options(client: bool = False) -> dict[str, Any]:
    """Extra `ray.init` arguments for the console: whether the actors' output comes to the driver at all, and
    Ray's driver log level (INFO when the log file takes it)."""
    if _console is None:
        return {"log_to_driver": True, "logging_level": logging.WARNING}
    routable = not client and _stdstream_dispatcher() is not None
    return {"log_to_driver": _console.verbose or routable, "logging_level": logging.INFO}


def route_ray_worker_output() -> None:
    """After `ray.init`: the actors' output goes to the log file; on the console only when verbose (and Ray's
    raylet/autoscaler lines, which say why a worker died, always)."""
    if _console is None:
        return
    open_log_file()  # Ray starting means preflight passed: the run is real
    dispatcher = _stdstream_dispatcher()
    if dispatcher is None:
        return
    _gate_library_logger("ray")
    try:
        from ray._private.worker import _global_node

        _console.file_handler.handle(logging.LogRecord(
            __name__, logging.INFO, __file__, 0, "Ray session logs (every actor's output, per node): %s",
            (_global_node.get_logs_dir_path(),), None))
    except (ImportError, AttributeError):
        pass
    dispatcher.remove_handler("rlhf_log_file")
    dispatcher.add_handler("rlhf_log_file", _write_worker_batch)
    if not _console.verbose:
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", _print_cluster_lines)


def _worker_prefix(batch: dict) -> str:
    name = batch.get("actor_name") or batch.get("task_name") or ""
    return f"({name} pid={batch.get('pid')}, ip={batch.get('ip')})".replace("( pid", "(pid")


def _write_worker_batch(batch: dict) -> None:
    if _console is None:
        return
    level = logging.WARNING if batch.get("is_err") else logging.INFO
    prefix = _worker_prefix(batch)
    for line in _cluster_lines(batch) if batch.get("pid") == "autoscaler" else batch.get("lines", []):
        record = logging.LogRecord(WORKER_OUTPUT_LOGGER, level, __file__, 0, f"{prefix} {line}", None, None)
        _console.file_handler.handle(record)


def _cluster_lines(batch: dict) -> list[str]:
    """The autoscaler's events in a batch, as Ray's own printer picks them (not its status table every 5 s)."""
    try:
        from ray._private.worker import filter_autoscaler_events

        return list(filter_autoscaler_events(batch.get("lines", [])))
    except Exception:  # noqa: BLE001 - raising here would stop Ray's log thread; Ray's own needs the GCS client
        return []


# Each rank prints rlhf_core's own warnings (a flag with no effect here, a fallback) with this prefix
# (`rank_warnings`), so quiet mode can show them on the console, once each, among the actors' output.
RANK_WARNING_PREFIX = WARNING_PREFIX
_rank_warnings_shown: set[str] = set()


def rank_warnings() -> None:
    """In a rank (a Ray actor): rlhf_core's warnings go to stderr as `rlhf: warning: <message>`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(RANK_WARNING_PREFIX + "%(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("rlhf_core").addHandler(handler)


def _print_cluster_lines(batch: dict) -> None:
    """Quiet mode's stand-in for Ray's printer: the raylet's lines (a worker killed for memory) and the
    autoscaler's events (a node lost or added), as Ray would print them, and the ranks' own rlhf_core
    warnings once each; no other actor output."""
    source, lines = batch.get("pid"), batch.get("lines", [])
    if source == "autoscaler":
        lines = _cluster_lines(batch)
    elif source != "raylet":
        for line in lines:
            if line.startswith(RANK_WARNING_PREFIX) and line not in _rank_warnings_shown:
                _rank_warnings_shown.add(line)
                end_live_line()
                sys.stderr.write(line + "\n")
        return
    for line in lines:
        end_live_line()
        sys.stderr.write(f"({source}) {line}\n")
