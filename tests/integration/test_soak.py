"""The short chaos soak (`make soak` runs the long one): the toy SFT then PPO as a deployment's run, 2 ranks on a
Ray cluster of 2 nodes, with a process worker under a supervisor, the automations, and 3 faults of 3 kinds: a rank
SIGKILLed, the flow-run process SIGKILLed (as the OOM killer does), and SIGTERM with no cancel (a preemption).
Nothing but the faults touches the run: it must complete with no human action, lose no commit, and end with the
weights of an uninterrupted run, tensor for tensor. tests/soak says how each fault is made and measured."""

from __future__ import annotations

import json

import pytest

from tests.soak.soak import SHORT, run_soak

pytestmark = pytest.mark.slow


def test_the_short_soak_heals_three_kinds_of_fault_with_no_person(tmp_path):
    """Slow (3-5 min): a Prefect server, a Ray cluster of 2 nodes, an uninterrupted run, then the faulted one."""
    result = run_soak(SHORT, tmp_path, seed=0)
    table = json.dumps(result, indent=1)
    assert result["faults"] >= 3 and len(result["kinds"]) >= 3, table
    assert result["completed"] and result["human_actions"] == 0, table
    assert result["commits_lost"] == 0, table
    assert result["bit_exact"], table
    for row in result["rows"]:  # each fault was seen, and training went on after it
        assert row["detect_s"] is not None and row["next_step_s"] is not None, table
    assert json.loads((tmp_path / "soak_report.json").read_text())["faults"] == result["faults"]
