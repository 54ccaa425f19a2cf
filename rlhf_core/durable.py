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
import errno
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


def replace_durably(path: str, data: bytes) -> None:
    """Replace `path` with `data` whole, durably: a temp file beside it (`.NAME.<random>`) written and fsync'd,
    renamed over it, and the folder fsync'd. Readers see the old bytes or the new, never a mix; after a power
    cut, the same."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
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
    """`os.makedirs(path, exist_ok=True)`, and every folder on the way made durable in its parent, up to the
    filesystem's root: folders someone else created (a lease, a log, plain `mkdir -p`) may never have been
    synced, and a commit inside an unsynced folder vanishes with it. A folder whose entries did not change
    syncs at almost no cost."""
    os.makedirs(path, exist_ok=True)
    current = os.path.abspath(path)
    while True:
        parent = os.path.dirname(current)
        if parent == current:
            return
        try:
            fsync_dir(parent)
        except OSError as error:  # a folder we may not read (--x), or a filesystem without folder fsync
            if error.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL):
                raise
        current = parent
