"""One warning line per process for a setting that has no effect here (or a reduced one), wherever it is
found: the data, the model, the precision, the DeepSpeed config."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class OncePerKey(logging.Filter):
    """Lets through the first record of each key (`extra={"rlhf_once": key}`). Installed on this module's logger,
    so logging holds the process's memory of what was said, beside its handlers."""

    def __init__(self) -> None:
        super().__init__()
        self.keys_seen: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "rlhf_once", None)
        if key is None:
            return True
        with self._lock:
            first = key not in self.keys_seen
            self.keys_seen.add(key)
        return first


logger.addFilter(OncePerKey())


def warn_once(message: str, key: str | None = None) -> None:
    """One warning line per process for a setting that has no effect (or a reduced one) here; with `key`, one
    per key (a message naming the first of many rows it applies to)."""
    logger.warning(message, extra={"rlhf_once": key or message})


def note_once(message: str, key: str | None = None) -> None:
    """One `rlhf: note:`-level line per process (INFO) for something a run does that the user should know of (data
    held out of training, a default that departs from OpenRLHF's)."""
    logger.info(message, extra={"rlhf_once": key or message})
