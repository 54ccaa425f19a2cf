"""What survives a power cut on a local or shared (NFS) filesystem, and the few calls that make it so: fsync of a
folder or of a tree's folders, the durable replace (temp + fsync + rename + fsync of the folder), durable folder
creation, and `WritebackAhead`, which hands a file's bytes to the disk while it is written. Object stores need none
of it. docs/design-notes.md ("Durable writes") has the POSIX rules this follows.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import tempfile
from typing import BinaryIO, Iterator

# Bytes written between two writeback requests (`WritebackAhead`): large enough that a request is rare,
# small enough that the fsync at the end finds little left to write.
WRITEBACK_WINDOW_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, wait for none


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


def pieces_of(block, piece_bytes: int) -> Iterator[memoryview]:
    """`block`'s bytes as consecutive views of at most `piece_bytes` each (no copy)."""
    view = memoryview(block).cast("B")
    for start in range(0, len(view), piece_bytes):
        yield view[start:start + piece_bytes]


def _load_sync_file_range():
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


class WritebackAhead:
    """A write-through file object that asks the kernel to start writing each window of bytes to disk as soon
    as the window is written (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, as RocksDB's `bytes_per_sync` does),
    so the disk works while the rest of the file is still being serialized and the closing fsync waits only
    for the last window. Without it a checkpoint's bytes stay dirty in the page cache (a 1.6 GB checkpoint is
    under the kernel's background-writeback threshold on most machines) and the whole write to disk happens
    inside the fsync, after serialization. It starts writeback only; durability still comes from the fsync.
    Where the call is missing or refused (not Linux, a filesystem without it) it does nothing.

    Large blocks are passed on in pieces of `_PIECE_BYTES`: on a VM whose kernel reports free memory to its host
    (Firecracker's page_reporting), MiB-sized write()s soon after memory was freed measured about 9x slower (1.2 GB:
    2.4-3.1 s in 4 MiB writes, 0.28 s in 64 KiB writes; cp's splice 0.30 s), likely because they take large
    page-cache folios from memory the host took back. But 64 KiB pieces made the fsync after them slower: a 1.2 GB
    torch.save made durable (write + fsync, 3 runs each, 4 s after the last file's pages were freed, 32 MiB
    writeback ahead) took 3.0-3.6 s in 64 KiB pieces, 2.7-2.85 s in 256 KiB, 2.7 s in 1 MiB, against 3.1-3.4 s for
    `cp` + fsync of the same bytes; without writeback ahead, 1 MiB pieces were the slowest (3.5-4.5 s). 256 KiB was
    best or level in every case measured."""

    _PIECE_BYTES = 256 << 10

    def __init__(self, target: BinaryIO, window_bytes: int | None = None):
        self.target, self.window_bytes = target, window_bytes or WRITEBACK_WINDOW_BYTES
        self._written = self._requested = 0
        self._enabled = _sync_file_range is not None

    def write(self, block) -> int:
        num_bytes = 0
        for piece in pieces_of(block, self._PIECE_BYTES):
            num_bytes += len(piece)
            self._written += self.target.write(piece)
            if self._enabled and self._written - self._requested >= self.window_bytes:
                self._request_writeback()
        return num_bytes

    def _request_writeback(self) -> None:
        self.target.flush()  # Python's buffer into the page cache first, or the range is not dirty yet
        if _sync_file_range(self.target.fileno(), self._requested, self._written - self._requested,
                            _SYNC_FILE_RANGE_WRITE) != 0:
            self._enabled = False  # EINVAL/ENOSYS/ESPIPE: this file cannot; the fsync still does it all
            return
        self._requested = self._written

    def flush(self) -> None:
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()
