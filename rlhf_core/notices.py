"""One warning line per process for a setting that has no effect here (or a reduced one), wherever it is
found: the data, the model, the precision, the DeepSpeed config."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def warn_once(message: str, key: str | None = None) -> None:
    """One warning line per process for a setting that has no effect (or a reduced one) here; with `key`, one
    per key (a message naming the first of many rows it applies to)."""
    if (key or message) not in _warned:
        _warned.add(key or message)
        logger.warning(message)
