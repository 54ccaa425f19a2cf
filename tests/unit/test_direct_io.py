"""rlhf_core.storage.direct_io: a local store writes checkpoint files around the page cache (O_DIRECT), whole aligned
buffers from a second thread, the unaligned end through the page cache; the bytes are the same whatever the size,
and a filesystem that refuses O_DIRECT (at the open or at the first write) gets them through the page cache."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from rlhf_core.errors import StoreFull
from rlhf_core.storage import direct_io
from rlhf_core.storage.checkpoint import CheckpointStore

BUFFER = 64 << 10  # small buffers, so a few hundred KiB cross several hand-offs


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every os.write the writer makes: (file offset, num_bytes, whether O_DIRECT was set on the file)."""
    seen: list[tuple[int, int, bool]] = []
    real_write = os.write

    def recording_write(fd: int, data) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        seen.append((os.lseek(fd, 0, os.SEEK_CUR), memoryview(data).nbytes, direct))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording_write)
    return seen


def _write(path: Path, data: bytes, piece: int) -> None:
    _write_blocks(path, [data[start:start + piece] for start in range(0, len(data), piece)])


def _write_blocks(path: Path, blocks: list) -> None:
    writer = direct_io.open_direct(str(path))
    assert writer is not None, f"O_DIRECT was refused on {path}"
    writer._buffer_bytes = BUFFER
    try:
        for block in blocks:
            writer.write(block)
        writer.flush()
        os.fsync(writer.fileno())
    finally:
        writer.close()


@pytest.mark.parametrize("num_bytes", [0, 1, 4095, 4096, BUFFER - 1, BUFFER, 3 * BUFFER + 12345])
@pytest.mark.parametrize("piece", [1000, 256 << 10])
def test_the_bytes_arrive_whatever_the_size_and_the_pieces(tmp_path: Path, num_bytes: int, piece: int):
    data = os.urandom(num_bytes)
    _write(tmp_path / "state.pt", data, piece)
    assert (tmp_path / "state.pt").read_bytes() == data


def test_whole_buffers_go_around_the_page_cache_and_only_the_last_block_through_it(tmp_path: Path, writes):
    data = os.urandom(3 * BUFFER + 12345)  # 12345 = 3 blocks of 4096 and 57 bytes
    _write(tmp_path / "state.pt", data, 256 << 10)
    assert writes == [(0, BUFFER, True), (BUFFER, BUFFER, True), (2 * BUFFER, BUFFER, True),
                      (3 * BUFFER, 12288, True), (3 * BUFFER + 12288, 57, False)]
    assert (tmp_path / "state.pt").read_bytes() == data


def test_a_filesystem_that_refuses_o_direct_at_the_open_gets_the_page_cache(tmp_path: Path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    assert direct_io.open_direct(str(tmp_path / "state.pt")) is None
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "model_states.pt").write_bytes(os.urandom(3 * BUFFER + 1))
    store = CheckpointStore(str(tmp_path / "store" / "run" / "sft"))
    store.commit(2, str(source), {"global_step": 2})
    assert store.list(verify=True)[0].is_committed


def test_a_filesystem_that_refuses_the_first_direct_write_gets_the_rest_through_the_page_cache(tmp_path, monkeypatch,
                                                                                               writes):
    real_write = os.write  # the recording one: it sees the refused call too

    def refusing_write(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing_write)
    data = os.urandom(2 * BUFFER + 100)
    _write(tmp_path / "state.pt", data, 4096)
    assert (tmp_path / "state.pt").read_bytes() == data
    assert writes and not any(direct for _, _, direct in writes)


def test_switched_off_by_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "0")
    assert direct_io.open_direct(str(tmp_path / "state.pt")) is None


def test_a_disk_that_fills_mid_file_is_a_full_store_and_leaves_no_file_open(tmp_path: Path, monkeypatch):
    real_write = os.write
    num_calls = []

    def filling_write(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            num_calls.append(1)
            if len(num_calls) == 3:  # in the writer thread, while the caller fills the next buffer
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "model_states.pt").write_bytes(os.urandom(40 << 20))
    store = CheckpointStore(str(tmp_path / "store" / "run" / "sft"))
    open_fds = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "write", filling_write)
    with pytest.raises(StoreFull, match=r"--ckpt_path .*/store/run/sft"):
        store.commit(2, str(source), {"global_step": 2})
    assert set(os.listdir("/proc/self/fd")) <= open_fds
    assert not [info for info in store.list() if info.is_committed]


def _page_aligned(data: bytes) -> memoryview:
    import mmap

    buffer = mmap.mmap(-1, len(data))
    buffer[:] = data
    return memoryview(buffer)


def test_a_page_aligned_block_at_an_aligned_place_is_written_from_where_it_lies(tmp_path: Path, writes, monkeypatch):
    """A snapshot's tensor (page-aligned memory) that lands at an aligned offset goes to the file without a copy:
    what the buffer held first, then the block's aligned part from the caller's memory; its tail is buffered."""
    monkeypatch.setattr(direct_io, "IN_PLACE_MIN_BYTES", 16 << 10)
    header, block = os.urandom(8192), _page_aligned(os.urandom(3 * BUFFER + 12345))
    seen_addresses: list[int] = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: seen_addresses.append(direct_io.address_of(memoryview(data)))
                        or real_write(fd, data))
    _write_blocks(tmp_path / "state.pt", [header, block])
    aligned_part = 3 * BUFFER + 12288
    assert writes == [(0, 8192, True), (8192, aligned_part, True), (8192 + aligned_part, 57, False)]
    assert seen_addresses[1] == direct_io.address_of(block), "the block's bytes went from where they lie"
    assert (tmp_path / "state.pt").read_bytes() == header + bytes(block)


@pytest.mark.parametrize("case", ["unaligned memory", "unaligned place in the file", "small"])
def test_a_block_not_aligned_in_memory_or_in_the_file_is_copied_into_the_buffer(tmp_path: Path, monkeypatch, case: str):
    monkeypatch.setattr(direct_io, "IN_PLACE_MIN_BYTES", 16 << 10)
    monkeypatch.setattr(direct_io.DirectWriter, "_write_in_place", lambda *args: pytest.fail("written in place"))
    data = os.urandom(2 * BUFFER + 100)
    block = {"unaligned memory": _page_aligned(b"x" * 8 + data)[8:], "unaligned place in the file": _page_aligned(data),
             "small": _page_aligned(data[:(16 << 10) - 1])}[case]
    header = b"h" * (100 if case == "unaligned place in the file" else 4096)
    _write_blocks(tmp_path / "state.pt", [header, block])
    assert (tmp_path / "state.pt").read_bytes() == header + bytes(block)
