"""The build lock torch's JIT loader leaves when a process dies while loading DeepSpeed's CPU op."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from rlhf_core import jit_build


@pytest.fixture
def op_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / jit_build.SHM_OP
    folder.mkdir()
    return folder


def _lock(folder, age_s: float):
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_older_than_any_check_of_a_built_op_is_removed_with_a_warning_naming_it(op_folder, caplog):
    (op_folder / f"{jit_build.SHM_OP}.so").touch()
    lock = _lock(op_folder, jit_build.STALE_WHEN_BUILT_S + 60)
    with caplog.at_level(logging.WARNING, logger=jit_build.__name__):
        jit_build.clear_stale_build_lock(poll_s=0.05)
    assert not lock.exists()
    assert str(lock) in caplog.text


def test_a_lock_as_old_as_a_first_build_is_waited_for_not_removed(op_folder, caplog):
    lock = _lock(op_folder, jit_build.STALE_WHEN_BUILT_S + 60)  # no .so yet: a first build may take this long
    released = threading.Timer(0.5, lock.unlink)
    released.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=jit_build.__name__):
        jit_build.clear_stale_build_lock(poll_s=0.05)
    released.join()
    assert time.monotonic() - started >= 0.45
    assert "removing" not in caplog.text


def test_a_fresh_lock_on_a_built_op_is_waited_for(op_folder):
    (op_folder / f"{jit_build.SHM_OP}.so").touch()
    lock = _lock(op_folder, 1)
    released = threading.Timer(0.3, lock.unlink)
    released.start()
    started = time.monotonic()
    jit_build.clear_stale_build_lock(poll_s=0.05)
    released.join()
    assert time.monotonic() - started >= 0.25


def test_no_lock_returns_at_once(op_folder):
    started = time.monotonic()
    jit_build.clear_stale_build_lock(poll_s=10)
    assert time.monotonic() - started < 5


def test_stale_locks_of_other_ops_go_too_and_fresh_ones_are_not_waited_for(op_folder):
    fused_adam, cpu_adam = op_folder.parent / "fused_adam", op_folder.parent / "cpu_adam"
    for other in (fused_adam, cpu_adam):
        other.mkdir()
        (other / f"{other.name}.so").touch()
    stale = _lock(fused_adam, jit_build.STALE_WHEN_BUILT_S + 60)
    fresh = _lock(cpu_adam, 1)
    started = time.monotonic()
    jit_build.clear_stale_build_lock(poll_s=10)
    assert time.monotonic() - started < 5
    assert not stale.exists() and fresh.exists()
