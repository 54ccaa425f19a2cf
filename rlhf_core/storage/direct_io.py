"""Checkpoint files written around the page cache (O_DIRECT), from two page-aligned buffers in turn: one fills while
a second thread writes the other, and large page-aligned blocks go from where they lie. Where the filesystem
refuses O_DIRECT the page cache is used; `RLHF_WRITER_DIRECT_IO=0` turns it off. docs/design-notes.md
("Direct I/O for checkpoint files") has why (the measurement) and how.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

DIRECT_IO_ENV = "RLHF_WRITER_DIRECT_IO"
# Large enough that the per-call cost (a syscall, the thread hand-off) is noise and the device sees long
# requests; small enough that two per open file cost little memory.
BUFFER_BYTES = 8 << 20
ALIGNMENT = 4096  # the largest logical block size in common use; O_DIRECT needs offset, length, address aligned
# Smaller blocks are copied into the buffer: a write of its own would cost more than the copy it saves.
IN_PLACE_MIN_BYTES = 1 << 20


def direct_io_enabled() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get(DIRECT_IO_ENV, "1") != "0"


def open_direct(path: str) -> DirectWriter | None:
    """A new (truncated) file at `path` for `DirectWriter`, or None where O_DIRECT is off or refused."""
    if not direct_io_enabled():
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.EINVAL:  # tmpfs before Linux 6.6, some FUSE filesystems
            return None
        raise
    return DirectWriter(fd)


class DirectWriter:
    """A write-only file object over `fd` (opened with O_DIRECT; the writer owns it and closes it); see
    docs/design-notes.md ("Direct I/O for checkpoint files"). `flush` puts every byte given so far into the file;
    `fileno` is for the caller's fsync."""

    def __init__(self, fd: int, buffer_bytes: int = BUFFER_BYTES):
        self._fd, self._buffer_bytes = fd, buffer_bytes
        self._buffers: list[mmap.mmap] = []  # made at the first write: a tiny file touches one page of one
        self._current = self._num_filled = 0
        self._direct, self._failed = True, False
        self._in_flight: Future | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="direct-write")

    def fileno(self) -> int:
        return self._fd

    def write(self, block) -> int:
        view = memoryview(block).cast("B")
        if len(view) >= IN_PLACE_MIN_BYTES and self._num_filled % ALIGNMENT == 0 and address_of(view) % ALIGNMENT == 0:
            self._write_in_place(view)
        else:
            self._copy_in(view)
        return len(view)

    def _write_in_place(self, view: memoryview) -> None:
        """`view`'s aligned part written to the file from the caller's memory, after what the buffer holds (an
        aligned length, so the file's end stays aligned), and only its tail (under one block) copied in."""
        self._wait()
        if self._num_filled:
            pending = memoryview(self._buffers[self._current])[:self._num_filled]
            self._num_filled = 0
            self._guarded(self._write_all, pending)
        num_aligned = len(view) // ALIGNMENT * ALIGNMENT
        self._guarded(self._write_all, view[:num_aligned])
        self._copy_in(view[num_aligned:])

    def _copy_in(self, view: memoryview) -> None:
        if not self._buffers:
            self._buffers = [mmap.mmap(-1, self._buffer_bytes) for _ in range(2)]
        start = 0
        while start < len(view):
            num_taken = min(self._buffer_bytes - self._num_filled, len(view) - start)
            self._buffers[self._current][self._num_filled:self._num_filled + num_taken] = view[start:start + num_taken]
            self._num_filled += num_taken
            start += num_taken
            if self._num_filled == self._buffer_bytes:
                self._hand_off()

    def flush(self) -> None:
        """Every byte written so far into the file (not to the disk: that is the caller's fsync)."""
        self._wait()
        if not self._num_filled:
            return
        pending = memoryview(self._buffers[self._current])[:self._num_filled]
        num_aligned = self._num_filled // ALIGNMENT * ALIGNMENT
        self._num_filled = 0
        self._guarded(self._write_all, pending[:num_aligned])
        if num_aligned < len(pending):
            self._stop_direct()  # the file's end is not aligned: from here on through the page cache
            self._guarded(self._write_all, pending[num_aligned:])

    def close(self) -> None:
        try:
            if not self._failed:
                self.flush()
        finally:
            self._writer.shutdown(wait=True)
            os.close(self._fd)
            self._buffers = []  # freed with the last view of them (a failed write's traceback may hold one)

    def _hand_off(self) -> None:
        """Send the full current buffer to the writer thread (after the previous one is written) and fill the other."""
        self._wait()
        self._in_flight = self._writer.submit(self._write_all, memoryview(self._buffers[self._current]))
        self._current ^= 1
        self._num_filled = 0

    def _wait(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._guarded(in_flight.result)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except BaseException:
            self._failed = True  # a full disk mid-file: close() releases and does not write again
            raise

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            try:
                num_written = os.write(self._fd, view)
            except OSError as error:
                if error.errno != errno.EINVAL or not self._direct:
                    raise
                self._stop_direct()  # refused at the write (an alignment this filesystem wants larger): retry
                continue
            view = view[num_written:]

    def _stop_direct(self) -> None:
        if self._direct:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self._direct = False


def address_of(view: memoryview) -> int:
    """Where `view`'s bytes start in memory (read-only views too, which ctypes cannot take)."""
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data if len(view) else 0
