"""Whether an output location can be written, asked before any training: a read-only `--save_path`, a path
below a file or an unreachable store is refused up front (one UserError sentence naming the flag) rather than
after all the training. Preflight asks it (`probe_writable`) of every output of a run, and `merge_lora` of its --output_path.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.errors import UserError
from rlhf_core.storage.locate import local_path, reaching_store


def probe_writable(url: str, flag: str, storage_options: dict | None = None) -> None:
    """`check_writable`, leaving no folder behind on a local disk: a refused run writes nothing."""
    path = local_path(url)
    first_missing = None
    if path is not None:
        for folder in [Path(path).absolute(), *Path(path).absolute().parents]:
            if folder.exists():
                break
            first_missing = folder
    try:
        check_writable(url, flag, storage_options)
    finally:
        if first_missing is not None and first_missing.is_dir():
            shutil.rmtree(first_missing, ignore_errors=True)


def check_writable(url: str, flag: str, storage_options: dict | None = None) -> None:
    """Write and remove a small probe file at `url` (created if missing); a location that cannot be
    written is a UserError naming `flag`."""
    probe_name = f".rlhf-write-probe-{uuid.uuid4().hex[:12]}"
    try:
        with reaching_store(flag, url, storage_options):
            filesystem, target = fsspec.core.url_to_fs(url, **(storage_options or {}))
            if filesystem.isfile(target):
                raise UserError(f"{flag}: {url} is a file; give a folder.")
            blocking = _file_above(target) if isinstance(filesystem, LocalFileSystem) else None
            if blocking is not None:
                raise UserError(f"{flag}: {url} cannot be a folder because {blocking} is a file; give another path.")
            filesystem.makedirs(target, exist_ok=True)
            probe = f"{target.rstrip('/')}/{probe_name}"
            filesystem.pipe_file(probe, b"rlhf write probe\n")
            filesystem.rm_file(probe)
    except (OSError, ValueError) as error:  # reaching_store already named an unreachable store
        raise UserError(f"{flag}: cannot write to {url} ({type(error).__name__}: {error}); choose a writable "
                        "location.") from None


def _file_above(path: str) -> str | None:
    """The nearest existing ancestor of a local `path` when it is a file (no folder can be made below it)."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            return str(parent) if parent.is_file() else None
    return None
