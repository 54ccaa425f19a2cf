"""Refuse checkpoint files that would run code when unpickled: `guard_checkpoint_loads` gives DeepSpeed's engines a
`torch.load(weights_only=True)` loader (tensors, containers and an allowlist of DeepSpeed's plain state classes),
and `check_no_pickled_code` scans what the universal-checkpoint converter will read. docs/design-notes.md
("Safe checkpoint loading") has the details.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import re

from rlhf_core.errors import UnsafeCheckpoint

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


def _allowed_globals() -> list:
    """DeepSpeed state classes that are plain data (no code runs when they are rebuilt)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # DeepSpeed absent: nothing of it can be in an allowlist
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refusal_reason(error: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found:
        return f"it would call {found.group(1)}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


_checkpoint_root: contextvars.ContextVar[str | None] = contextvars.ContextVar("checkpoint_root", default=None)
# The last file read inside `reading_checkpoint`: {"key": (path, mapping), "value": what torch.load returned}.
_last_read: contextvars.ContextVar[dict | None] = contextvars.ContextVar("last_read", default=None)


@contextlib.contextmanager
def reading_checkpoint(directory: str):
    """Name refused files relative to `directory` (the checkpoint folder being loaded)."""
    token, last_read = _checkpoint_root.set(directory), _last_read.set({})
    try:
        yield
    finally:
        _checkpoint_root.reset(token)
        _last_read.reset(last_read)


def _load_plain_data(path: str, root: str, map_location=None):
    import torch

    with torch.serialization.safe_globals(_allowed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError) as error:
            raise UnsafeCheckpoint(
                f"{os.path.relpath(path, root)} holds pickled objects that are not plain tensors "
                f"({_refusal_reason(error)}); refusing to load it. Restore this checkpoint from a trusted copy."
            ) from None


def guard_checkpoint_loads(engine) -> None:
    """Make `engine` (a DeepSpeedEngine) read its checkpoint files as plain data only."""
    loader = engine.checkpoint_engine

    def load(path, map_location=None):
        last = _last_read.get()
        # DeepSpeed maps to CPU with lambdas (a new one per call): any callable counts as the same mapping.
        key = (os.path.realpath(path), "callable" if callable(map_location) else str(map_location))
        if last is not None and last.get("key") == key:
            return last["value"]
        value = _load_plain_data(path, _checkpoint_root.get() or os.path.dirname(path), map_location)
        if last is not None:
            last.update(key=key, value=value)  # one entry: a new file replaces the last one
        return value

    loader.load = load


def check_no_pickled_code(directory: str) -> int:
    """Scan every pickle-based file below `directory`; returns how many were scanned."""
    num_scanned = 0
    for root, _, file_names in os.walk(directory):
        for file_name in sorted(name for name in file_names if name.endswith(PICKLE_SUFFIXES)):
            _load_plain_data(os.path.join(root, file_name), directory, map_location="cpu")
            num_scanned += 1
    return num_scanned
