"""A FUSE filesystem for power-cut tests: a pass-through to a backing folder that remembers what a real disk
would keep if the power went now, and can make that true.

It passes every operation through to BACKING, and beside it keeps the *durable image* of the tree, by inode
(the backing filesystem's, stable across renames):
- a file's bytes become durable when it is fsync'd (its content at that moment);
- a folder's entries (names -> inodes: creates, renames, unlinks, links) become durable when the folder is
  fsync'd;
everything else stays volatile, as the page cache and the journal leave it. What was in BACKING at mount
counts as durable. A name that is durable but whose file never was fsync'd comes back empty (ext4's
zero-length files after a crash); a folder that never was fsync'd comes back empty.

A power cut: create `.powercut` at the top of the mount (an ordinary file, passed through), kill the
writers, unmount. The process then replaces BACKING's contents with the durable image and exits. Mount again
to see what survived.

Torn writes (`--torn-writes`, or POWERCUT_TORN_WRITES=1 for `PowerCutMount`): a disk may also keep part of
what was never fsync'd, having written some of a file's blocks before the power went. In this mode a file
whose name survives keeps, beyond the bytes it shares with its last fsync'd content, the first half of what
was written after that (a real disk tears at a block; here at any byte, which is harsher): a reader then finds
a file that is neither empty nor whole. Only files still reachable by some name at the cut can tear; one
unlinked since keeps its fsync'd bytes. The log names every file a cut tore.

Other departures from a real disk: metadata such as modes and times is not modelled, and without torn writes
data is never made durable without an fsync (a real disk may keep more, which torn writes stand for).

    python -m tests.powercut_fs BACKING MOUNTPOINT [--torn-writes]
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mfusepy
from mfusepy import FUSE, FuseOSError, Operations

CUT_MARKER = ".powercut"
TORN_WRITES_ENV = "POWERCUT_TORN_WRITES"
PROJECT_DIR = Path(__file__).resolve().parents[1]


def torn_content(durable: bytes, now: bytes) -> bytes:
    """What a torn write leaves of a file whose last fsync'd bytes were `durable` and whose bytes are `now`:
    the bytes they share from the start, then the first half of the rest of `now` (a file truncated since its
    fsync keeps its shorter length)."""
    shared = len(os.path.commonprefix([durable, now]))  # works on any sequences, bytes too
    return now[:shared + (len(now) - shared) // 2]


class PowerCutFS(Operations):
    use_ns = True  # utimens gets nanoseconds, as os.utime(ns=...) takes them

    def __init__(self, backing: str, torn_writes: bool = False):
        self.backing = os.path.abspath(backing)  # FUSE changes the working directory
        self.torn_writes = torn_writes
        self._state_lock = threading.Lock()
        self.durable_entries: dict[int, dict[str, tuple[int, bool]]] = {}  # folder inode -> name -> (inode, is dir)
        self.durable_bytes: dict[int, bytes] = {}
        self.root_inode = os.stat(self.backing).st_ino
        for folder, _, files in os.walk(self.backing):
            self._record_folder(folder)
            for name in files:
                self._record_file(os.path.join(folder, name))

    # --------------------------------------------------------------- durability
    def _record_folder(self, real: str) -> None:
        entries = {}
        with os.scandir(real) as scan:
            for entry in scan:
                if entry.name != CUT_MARKER:
                    entries[entry.name] = (entry.inode(), entry.is_dir(follow_symlinks=False))
        with self._state_lock:
            self.durable_entries[os.stat(real).st_ino] = entries

    def _record_file(self, real: str, fd: int | None = None) -> None:
        source = f"/proc/self/fd/{fd}" if fd is not None else real
        with open(source, "rb") as stream:
            data = stream.read()
        inode = os.fstat(fd).st_ino if fd is not None else os.stat(real).st_ino
        with self._state_lock:
            self.durable_bytes[inode] = data

    def apply_durable_image(self) -> None:
        """Make BACKING what the durable image says: what a disk would show after the power came back."""
        contents = {}
        if self.torn_writes:  # read before BACKING is emptied
            contents = {inode: torn_content(self.durable_bytes.get(inode, b""), now)
                        for inode, now in self._current_durable_files().items()}
        for name in os.listdir(self.backing):
            path = os.path.join(self.backing, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        self._materialise(self.root_inode, self.backing, contents)

    def _current_durable_files(self) -> dict[int, bytes]:
        """The bytes in BACKING now (before the cut takes effect) of each file a durable name points at, by
        inode: what a torn write keeps part of."""
        with self._state_lock:
            wanted = {inode for entries in self.durable_entries.values() for inode, is_dir in entries.values()
                      if not is_dir}
        found: dict[int, bytes] = {}
        for folder, _, files in os.walk(self.backing):
            for name in files:
                path = os.path.join(folder, name)
                inode = os.lstat(path).st_ino
                if inode in wanted and inode not in found and not os.path.islink(path):
                    with open(path, "rb") as stream:
                        found[inode] = stream.read()
        return found

    def _materialise(self, folder_inode: int, real: str, contents: dict[int, bytes]) -> None:
        """Write the durable tree below `folder_inode` at `real`; a file's bytes from `contents` (torn) when
        there, else its fsync'd bytes."""
        for name, (inode, is_dir) in sorted(self.durable_entries.get(folder_inode, {}).items()):
            target = os.path.join(real, name)
            if is_dir:
                os.mkdir(target)
                self._materialise(inode, target, contents)
            else:
                durable = self.durable_bytes.get(inode, b"")
                kept = contents.get(inode, durable)
                if kept != durable:  # the log says which files a cut tore, for a test that wonders
                    print(f"torn write: {target}: {len(kept)} bytes kept, {len(durable)} were fsync'd", flush=True)
                with open(target, "wb") as stream:
                    stream.write(kept)

    # --------------------------------------------------------------- pass-through
    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _call(self, function, *args):
        try:
            return function(*args)
        except OSError as error:
            raise FuseOSError(error.errno or errno.EIO) from None

    def getattr(self, path, fh=None):
        st = self._call(os.lstat, self._real(path))
        return {key: getattr(st, key) for key in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                                   "st_nlink", "st_size", "st_uid", "st_ino")}

    def readdir(self, path, fh):
        return [".", "..", *self._call(os.listdir, self._real(path))]

    def statfs(self, path):
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                   "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def access(self, path, amode):
        if not os.access(self._real(path), amode):
            raise FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        return self._call(os.chmod, self._real(path), mode)

    def chown(self, path, uid, gid):
        return self._call(os.chown, self._real(path), uid, gid)

    def utimens(self, path, times=None):
        return self._call(lambda real: os.utime(real, ns=times) if times else os.utime(real), self._real(path))

    def readlink(self, path):
        return self._call(os.readlink, self._real(path))

    def symlink(self, target, source):
        return self._call(os.symlink, source, self._real(target))

    def mkdir(self, path, mode):
        return self._call(os.mkdir, self._real(path), mode)

    def rmdir(self, path):
        return self._call(os.rmdir, self._real(path))

    def unlink(self, path):
        return self._call(os.unlink, self._real(path))

    def rename(self, old, new):
        return self._call(os.rename, self._real(old), self._real(new))

    def link(self, target, source):
        return self._call(os.link, self._real(source), self._real(target))

    def open(self, path, flags):
        return self._call(os.open, self._real(path), flags)

    def create(self, path, mode, fi=None):
        return self._call(os.open, self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        return self._call(os.pread, fh, size, offset)

    def write(self, path, data, offset, fh):
        return self._call(os.pwrite, fh, data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            return self._call(os.ftruncate, fh, length)
        with open(self._real(path), "r+b") as stream:
            stream.truncate(length)

    def flush(self, path, fh):
        return 0  # close() is not fsync: nothing becomes durable here

    def release(self, path, fh):
        return self._call(os.close, fh)

    def fsync(self, path, datasync, fh):
        self._record_file(self._real(path), fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        self._record_folder(self._real(path))
        return 0


class PowerCutMount:
    """The filesystem above, mounted by a process of its own at `mountpoint` over `backing`, for a test:
    `cut()` is a power cut (writers must be dead: kill them first), after which the mount is back."""

    def __init__(self, backing: Path, mountpoint: Path, log: Path, torn_writes: bool | None = None):
        """`torn_writes`: cuts tear un-fsync'd writes (see the module); None reads POWERCUT_TORN_WRITES=1, so a
        whole test (the fault matrix's power-cut chain) can be rerun in that mode."""
        self.backing, self.mountpoint, self.log = backing, mountpoint, log
        self.torn_writes = os.environ.get(TORN_WRITES_ENV) == "1" if torn_writes is None else torn_writes
        backing.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    def mount(self, timeout_s: float = 30) -> None:
        with open(self.log, "ab") as log:
            command = [sys.executable, "-m", "tests.powercut_fs", str(self.backing), str(self.mountpoint)]
            if self.torn_writes:
                command.append("--torn-writes")
            self.process = subprocess.Popen(command, cwd=PROJECT_DIR, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.ismount(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the power-cut filesystem did not mount:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def unmount(self, cut: bool = False) -> None:
        if cut:
            (self.mountpoint / CUT_MARKER).touch()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=True)
        assert self.process is not None
        self.process.wait(timeout=60)

    def cut(self) -> None:
        """Power off and on: what was not durable is gone; the mount is back."""
        self.unmount(cut=True)
        self.mount()

    def __enter__(self) -> "PowerCutMount":
        self.mount()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def main(backing: str, mountpoint: str, *options: str) -> None:
    filesystem = PowerCutFS(backing, torn_writes="--torn-writes" in options)
    FUSE(filesystem, mountpoint, foreground=True, nothreads=False)
    if os.path.exists(os.path.join(filesystem.backing, CUT_MARKER)):
        filesystem.apply_durable_image()


if __name__ == "__main__":
    assert mfusepy, "mfusepy is needed (pip install mfusepy; apt-get install fuse3)"
    main(*sys.argv[1:])
