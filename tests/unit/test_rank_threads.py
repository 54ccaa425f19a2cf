"""How many torch threads a rank takes: the driver's OMP_NUM_THREADS, else its share of the CPUs it may run on."""

from __future__ import annotations

import os

import pytest

from rlhf_core.driver.ray_start import threads_asked
from rlhf_core.errors import UserError
from rlhf_core.rank.threads import torch_threads


def test_a_rank_shares_the_cpus_it_may_run_on_not_the_hosts(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # a container's 8 of a bigger host
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert torch_threads(None, ranks_on_node=4) == 2
    assert torch_threads(None, ranks_on_node=16) == 1


def test_the_drivers_omp_num_threads_wins(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torch_threads(threads_asked(), ranks_on_node=1) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_asked() is None and torch_threads(threads_asked(), ranks_on_node=1) == 8


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_one_sentence_naming_it(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(UserError, match=f"OMP_NUM_THREADS='{value}': expected a whole number of threads"):
        threads_asked()
