"""The build lock torch's JIT loader leaves when a process dies while loading DeepSpeed's CPU op.

`jit_build`'s sleep is replaced by a recorder that can release a lock on a given poll, as a live holder
would, so the tests see whether it waited without timing anything."""

from __future__ import annotations

import logging
import os
import time

import pytest

from rlhf_core.rank import jit_build


@pytest.fixture
def op_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / jit_build.SHM_OP
    folder.mkdir()
    return folder


@pytest.fixture
def polls(monkeypatch):
    """The sleeps jit_build takes while waiting; `release_on[n] = lock` removes `lock` at the n-th one."""
    taken: list[float] = []
    release_on: dict[int, os.PathLike] = {}

    def sleep(seconds: float) -> None:
        taken.append(seconds)
        if len(taken) in release_on:
            os.remove(release_on[len(taken)])
        assert len(taken) < 100, "waited on a lock nobody releases"

    monkeypatch.setattr(jit_build.time, "sleep", sleep)
    return taken, release_on


def _lock(folder, age_s: float):
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_older_than_any_check_of_a_built_op_is_removed_with_a_warning_naming_it(op_folder, polls, caplog):
    (op_folder / f"{jit_build.SHM_OP}.so").touch()
    lock = _lock(op_folder, jit_build.STALE_WHEN_BUILT_S + 60)
    with caplog.at_level(logging.WARNING, logger=jit_build.__name__):
        jit_build.clear_stale_build_lock()
    assert not lock.exists()
    assert str(lock) in caplog.text
    assert polls[0] == [], "a stale lock is removed, not waited for"


def test_a_lock_as_old_as_a_first_build_is_waited_for_not_removed(op_folder, polls, caplog):
    lock = _lock(op_folder, jit_build.STALE_WHEN_BUILT_S + 60)  # no .so yet: a first build may take this long
    taken, release_on = polls
    release_on[3] = lock
    with caplog.at_level(logging.WARNING, logger=jit_build.__name__):
        jit_build.clear_stale_build_lock()
    assert len(taken) == 3, "it waited until the holder released the lock"
    assert "removing" not in caplog.text


def test_a_fresh_lock_on_a_built_op_is_waited_for(op_folder, polls):
    (op_folder / f"{jit_build.SHM_OP}.so").touch()
    lock = _lock(op_folder, 1)
    taken, release_on = polls
    release_on[2] = lock
    jit_build.clear_stale_build_lock()
    assert len(taken) == 2


def test_no_lock_returns_at_once(op_folder, polls):
    jit_build.clear_stale_build_lock()
    assert polls[0] == []


def test_stale_locks_of_other_ops_go_too_and_fresh_ones_are_not_waited_for(op_folder, polls):
    fused_adam, cpu_adam = op_folder.parent / "fused_adam", op_folder.parent / "cpu_adam"
    for other in (fused_adam, cpu_adam):
        other.mkdir()
        (other / f"{other.name}.so").touch()
    stale = _lock(fused_adam, jit_build.STALE_WHEN_BUILT_S + 60)
    fresh = _lock(cpu_adam, 1)
    jit_build.clear_stale_build_lock()
    assert polls[0] == []
    assert not stale.exists() and fresh.exists()
