"""Refuse checkpoint files that would run code when unpickled.

DeepSpeed reads its own state with `torch.load(weights_only=False)`, which executes whatever a pickle
asks for. Before DeepSpeed (or its universal-checkpoint converter) touches a downloaded checkpoint,
every pickle-based file is opened once with `torch.load(weights_only=True)`: tensors, containers and
a short allowlist of DeepSpeed's plain state classes pass; anything else (say `os.system`) is refused
with the file and the offending global named. Safetensors and JSON files need no scan.
"""

from __future__ import annotations

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


def check_no_pickled_code(directory: str) -> int:
    """Scan every pickle-based file below `directory`; returns how many were scanned."""
    import torch

    num_scanned = 0
    with torch.serialization.safe_globals(_allowed_globals()):
        for root, _, file_names in os.walk(directory):
            for file_name in sorted(file_names):
                if not file_name.endswith(PICKLE_SUFFIXES):
                    continue
                path = os.path.join(root, file_name)
                try:
                    torch.load(path, map_location="cpu", weights_only=True)
                except (pickle.UnpicklingError, RuntimeError, AttributeError) as error:
                    raise UnsafeCheckpoint(
                        f"{os.path.relpath(path, directory)} holds pickled objects that are not plain tensors "
                        f"({_refusal_reason(error)}); refusing to load it. Restore this checkpoint from a trusted copy."
                    ) from None
                num_scanned += 1
    return num_scanned
