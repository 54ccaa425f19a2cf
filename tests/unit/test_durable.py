"""rlhf_core.storage.durable's writeback ahead: where a checkpoint file goes through the page cache (O_DIRECT off or
refused, `direct_io`), the disk is asked to write each window of it as soon as the window is in the page cache, so
the closing fsync finds little left to write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhf_core.storage import direct_io, durable
from rlhf_core.storage.checkpoint import CheckpointStore

WINDOW = 1 << 20


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, int]]:
    """Every sync_file_range the code asks for, as (offset, num_bytes, flags, file size on disk at the call)."""
    asked: list[tuple[int, int, int, int]] = []

    def record(fd: int, offset: int, num_bytes: int, flags: int) -> int:
        asked.append((offset, num_bytes, flags, os.fstat(fd).st_size))
        return 0

    monkeypatch.setattr(durable, "_sync_file_range", record)
    return asked


def _write_in_pieces(target, data: bytes, piece: int = 64 << 10) -> None:
    for start in range(0, len(data), piece):
        target.write(data[start:start + piece])


def test_each_window_is_asked_for_once_in_order_after_it_reached_the_page_cache(tmp_path: Path, requests):
    data = os.urandom(10 * WINDOW + 12345)
    path = tmp_path / "state.pt"
    # A buffer larger than a window: without the flush before each request, the range would not be written yet.
    with open(path, "wb", buffering=4 * WINDOW) as handle:
        _write_in_pieces(durable.WritebackAhead(handle, WINDOW), data)
    assert path.read_bytes() == data
    assert [flags for _, _, flags, _ in requests] == [2] * 10  # SYNC_FILE_RANGE_WRITE: start, never wait
    assert [offset for offset, _, _, _ in requests] == [index * WINDOW for index in range(10)]
    assert all(num_bytes == WINDOW for _, num_bytes, _, _ in requests)
    assert all(size_on_disk >= offset + num_bytes for offset, num_bytes, _, size_on_disk in requests)


def test_a_refused_request_turns_it_off_and_the_bytes_still_arrive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(durable, "_sync_file_range", lambda *args: calls.append(args) or -1)
    data = os.urandom(5 * WINDOW)
    path = tmp_path / "state.pt"
    with open(path, "wb") as handle:
        _write_in_pieces(durable.WritebackAhead(handle, WINDOW), data)
    assert len(calls) == 1 and path.read_bytes() == data


def test_the_real_call_is_accepted_on_this_filesystem(tmp_path: Path):
    if durable._sync_file_range is None:
        pytest.skip("no sync_file_range in this libc")
    data = os.urandom(3 * WINDOW)
    with open(tmp_path / "state.pt", "wb") as handle:
        writer = durable.WritebackAhead(handle, WINDOW)
        _write_in_pieces(writer, data)
        assert writer._enabled, "sync_file_range was refused"
    assert (tmp_path / "state.pt").read_bytes() == data


def test_a_local_commit_through_the_page_cache_writes_its_files_ahead_and_an_object_store_does_not(
        tmp_path: Path, requests, monkeypatch):
    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "0")  # the path where O_DIRECT is off or refused
    monkeypatch.setattr(durable, "WRITEBACK_WINDOW_BYTES", WINDOW)
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "model_states.pt").write_bytes(os.urandom(4 * WINDOW))
    local = CheckpointStore(str(tmp_path / "store" / "run" / "sft"))
    local.commit(2, str(source), {"global_step": 2})
    assert [offset for offset, _, _, _ in requests] == [index * WINDOW for index in range(4)]
    assert local.list(verify=True)[0].is_committed
    requests.clear()
    CheckpointStore("memory://writeback-ahead/run/sft").commit(2, str(source), {"global_step": 2})
    assert requests == []
