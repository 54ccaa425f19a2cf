"""The rank's background writer yields the CPU to training: its thread, and the threads it starts, run under
Linux's SCHED_IDLE; the training thread keeps its policy; RLHF_WRITER_SCHEDULING=normal turns it off (the bench's
side-by-side comparison)."""

from __future__ import annotations

import os
import threading

import pytest

from rlhf_core.rank.threads import WRITER_SCHEDULING_ENV, yield_cpu_to_training

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def policies_in_a_writer_thread() -> tuple[bool, int, int]:
    """(what yield_cpu_to_training returned, the writer thread's policy, the policy of a thread it started)."""
    seen = {}

    def child():
        seen["child"] = os.sched_getscheduler(threading.get_native_id())

    def writer():
        seen["yielded"] = yield_cpu_to_training()
        started = threading.Thread(target=child)
        started.start()
        started.join()
        seen["writer"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    return seen["yielded"], seen["writer"], seen["child"]


def test_the_writer_and_its_threads_run_idle_and_training_keeps_its_policy(monkeypatch):
    monkeypatch.delenv(WRITER_SCHEDULING_ENV, raising=False)
    before = os.sched_getscheduler(threading.get_native_id())
    assert policies_in_a_writer_thread() == (True, os.SCHED_IDLE, os.SCHED_IDLE)
    assert os.sched_getscheduler(threading.get_native_id()) == before


def test_normal_scheduling_leaves_the_writer_as_it_is(monkeypatch):
    monkeypatch.setenv(WRITER_SCHEDULING_ENV, "normal")
    assert policies_in_a_writer_thread() == (False, os.SCHED_OTHER, os.SCHED_OTHER)
