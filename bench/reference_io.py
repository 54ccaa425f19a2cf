"""The physical limits the checkpoint rows are held against: the same bytes copied and made durable, read
from a cold page cache, and hashed alone.

- `durable_copy`: `cp -r` of a step folder, then fsync of every file and every folder (deepest first,
  then the folder that received the copy). A copy into the page cache is not a checkpoint: a power cut
  takes it. The project's commit fsyncs the same things (rlhf_core/storage/durable.py), so this is the cheapest
  durable copy of the bytes a save writes.
- `cold_read`: `cat` of the files a rank reads into /dev/null after `drop_page_cache`, which is what a
  resume on a fresh node reads them from.
- `hash_seconds`: one algorithm over the same files from the page cache, one core, no copy (mmap).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import time
from typing import Callable

DROP_CACHES = "/proc/sys/vm/drop_caches"


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_copy(source: str, target: str) -> None:
    """`cp -r source target`, then every file and folder of `target` fsync'd, and `target`'s parent."""
    subprocess.run(["cp", "-r", source, target], check=True)
    folders = []
    for dirpath, _, filenames in os.walk(target):
        folders.append(dirpath)
        for filename in filenames:
            fsync_path(os.path.join(dirpath, filename))
    for folder in sorted(folders, key=lambda path: path.count(os.sep), reverse=True):
        fsync_path(folder, directory=True)
    fsync_path(os.path.dirname(os.path.abspath(target)), directory=True)


def timed_copies(copy: Callable[[str, str], None], source: str, target: str, repeat: int) -> float:
    """Median seconds of `copy(source, target)`, each from flushed dirty pages (as before each checkpoint)
    and with `target` removed before and after."""
    seconds = []
    for _ in range(repeat):
        shutil.rmtree(target, ignore_errors=True)
        os.sync()
        started = time.perf_counter()
        copy(source, target)
        seconds.append(time.perf_counter() - started)
    shutil.rmtree(target, ignore_errors=True)
    return statistics.median(seconds)


def page_copy(source: str, target: str) -> None:
    """Plain `cp -r`: into the page cache only (the old reference, kept for comparison)."""
    subprocess.run(["cp", "-r", source, target], check=True)


def drop_page_cache() -> bool:
    """Write back dirty pages and empty the page cache (root only); False where that is not allowed."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as handle:
            handle.write("3\n")
    except OSError:
        return False
    return True


def cold_read(root: str, relative_paths: list[str]) -> float:
    """Seconds to `cat` the files into /dev/null right after the page cache was dropped (no drop, no cold)."""
    drop_page_cache()
    started = time.perf_counter()
    subprocess.run(["cat", *relative_paths], cwd=root, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def warm_read(root: str, relative_paths: list[str]) -> float:
    subprocess.run(["cat", *relative_paths], cwd=root, check=True, stdout=subprocess.DEVNULL)  # into the cache
    started = time.perf_counter()
    subprocess.run(["cat", *relative_paths], cwd=root, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def hash_seconds(root: str, relative_paths: list[str], algorithm: str, repeat: int) -> float:
    """Median seconds to hash the files with `algorithm` (the manifest's hashers), one after another on one
    core, from the page cache (mmap: no copy, no write)."""
    from rlhf_core.storage.manifest import new_hasher

    # Into the page cache first, so every algorithm reads from memory.
    subprocess.run(["cat", *relative_paths], cwd=root, check=True, stdout=subprocess.DEVNULL)
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        for relative_path in relative_paths:
            path = os.path.join(root, relative_path)
            if not os.path.getsize(path):
                continue
            hasher = new_hasher(algorithm)
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
                hasher.update(view)
            hasher.hexdigest()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)
