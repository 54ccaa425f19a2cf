"""What survives a power cut on a local or shared (NFS) filesystem, and the few calls that make it so.

POSIX makes a file's bytes durable when the file is fsync'd, and a name (a create, rename or unlink) durable
when the directory holding it is fsync'd; a rename reaches the disk in no fixed order relative to the data
of the file it names. ext4, XFS and NFS (whose COMMIT an fsync sends) follow this. So a durable replace is:
write a temporary file in the same folder, fsync it, rename it over the name, fsync the folder.

Object stores need none of it: a PUT that returned is durable (S3, GCS and Azure Blob acknowledge a write
only once it is stored redundantly), and there is no rename to order. Callers skip these calls there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_dir(path: str) -> None:
    """Make the names in folder `path` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: str) -> None:
    """fsync every folder below `root` and `root` itself, deepest first, so each name lands before its parent's."""
    folders = [dirpath for dirpath, _, _ in os.walk(root)]
    for folder in sorted(folders, key=lambda path: path.count(os.sep), reverse=True):
        fsync_dir(folder)


def replace_durably(path: str, data: bytes, prefix: str = ".tmp.") -> None:
    """Replace `path` with `data` whole, durably: temp file + fsync + rename + fsync of the folder. Readers see
    the old bytes or the new, never a mix; after a power cut, the same."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_dir(folder)


def make_dirs_durably(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)`, with every folder it created made durable in its parent."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        current = os.path.dirname(current)
    os.makedirs(path, exist_ok=True)
    for folder in reversed(missing):
        fsync_dir(os.path.dirname(folder))
