"""The run's log file (`logs/driver.log` in a local run folder, else ./rlhf-logs/<run>.log): a handler that holds
records until the run is real, then writes them all, and stops with one warning if the file cannot be written."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, cast

from rlhf_core.storage.locate import local_path

LOG_DIR_NAME = "logs"
LOG_FILE_NAME = "driver.log"
REMOTE_FALLBACK_DIR = "rlhf-logs"
FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s - %(message)s"
MAX_HELD_RECORDS = 100_000  # before the file opens (preflight's few records; a bound, not a budget)


def log_file_for(run_url: str, run_name: str) -> str:
    """Where `configure_console` writes for a run: in the run folder when it is local, else ./rlhf-logs."""
    local = local_path(run_url)
    if local is None:
        return os.path.abspath(os.path.join(REMOTE_FALLBACK_DIR, f"{run_name}.log"))
    return os.path.join(os.path.abspath(local), LOG_DIR_NAME, LOG_FILE_NAME)


class FailSafeFileHandler(logging.FileHandler):
    """A FileHandler that, when its file cannot be written (a full disk, a lost mount), says so once on the
    console and stops writing, instead of printing logging's traceback for every record that follows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # logging.FileHandler's
        super().__init__(*args, **kwargs)
        self.failed = False

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


class RunLogHandler(logging.Handler):
    """The log file, opened only once the run is real: records are held in memory until `open()` (Ray starts,
    or the CLI sees the run end other than by a UserError), so a run refused by preflight writes nothing."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.owner: object | None = None  # the quiet console (rlhf_core.ops.console) that installed this handler
        self._held: list[logging.LogRecord] = []
        self._file: FailSafeFileHandler | None = None

    @property
    def _lock(self) -> threading.RLock:
        # logging.Handler.__init__ made it; typeshed has it Optional, for a handler that never ran that
        return cast(threading.RLock, self.lock)

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def open(self) -> bool:
        """Create the file and write what was held; True when this call opened it."""
        with self._lock:
            if self._file is not None:
                return False
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = FailSafeFileHandler(self.path, encoding="utf-8")
            except OSError as error:  # the run goes on without its file
                self._file = FailSafeFileHandler(os.devnull, encoding="utf-8")
                self._file.failed = True
                warn_log_file_lost(self.path, error)
            # Not self.formatter: ray.init(configure_logging=True) sets the format of every handler on the
            # "ray" logger, this one included.
            self._file.setFormatter(logging.Formatter(FILE_FORMAT))
            for record in self._held:
                self._file.emit(record)
            self._held.clear()
            return True

    def discard(self) -> None:
        with self._lock:
            self._held.clear()

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is not None:
            if not self._file.failed:
                self._file.emit(record)
        elif len(self._held) < MAX_HELD_RECORDS:
            self._held.append(record)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
        super().close()
