"""The benchmark suite's arithmetic (bench/table.py): ratios, goals, chunk boundaries, and
the table's cells. No timing is measured or asserted here."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "table.py")
_spec = importlib.util.spec_from_file_location("bench_table", _PATH)
table = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = table  # dataclasses look their module up there
_spec.loader.exec_module(table)


def test_cost_ratio_is_ours_over_reference_and_met_at_the_bound():
    row = table.Row("SFT s/step", reference=0.2, ours=0.25, unit="s", goal_op="<=", goal=1.25)
    assert row.ratio == pytest.approx(1.25)
    assert row.met is True  # the bound itself meets the goal
    assert table.Row("x", 0.2, 0.26, "s", "<=", 1.25).met is False


def test_throughput_goal_reads_at_least():
    row = table.Row("GRPO samples/s", reference=40.0, ours=30.0, unit="/s", goal_op=">=", goal=1.0)
    assert row.ratio == pytest.approx(0.75)
    assert row.met is False
    assert table.Row("x", 40.0, 68.0, "/s", ">=", 1.0).met is True


def test_missing_or_zero_reference_is_neither_met_nor_missed():
    for row in (table.Row("x", None, 1.0, "s", "<=", 1.0), table.Row("x", 0.0, 1.0, "s", "<=", 1.0),
                table.Row("x", 1.0, None, "s", "<=", 1.0)):
        assert row.ratio is None and row.met is None
        assert row.cells()[3:] == ["n/a", "<= 1.00x", "n/a"]


def test_percent_row_and_table_cells():
    row = table.Row("outside / 50-step chunk", reference=15.0, ours=0.3, unit="s", goal_op="<=", goal=0.02,
                    as_percent=True)
    assert row.cells() == ["outside / 50-step chunk", "15 s", "0.3 s", "2.0%", "<= 2.0%", "yes"]
    text = table.format_table([row, table.Row("SFT s/step", 0.131, 0.327, "s", "<=", 1.0)])
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "measure" and set(lines[1]) <= {"|", "-"}
    assert [cell.strip() for cell in lines[3].split("|")[1:-1]] == ["SFT s/step", "0.131 s", "0.327 s", "2.50x",
                                                                    "<= 1.00x", "NO"]
    assert len({len(line) for line in lines}) == 1  # columns padded to one width


def test_outside_per_chunk_is_period_less_the_ranks_loop():
    # chunks end at 10, 26, 41.5; the ranks looped 10, 15 and 15 s: 1 s then 0.5 s outside training
    assert table.outside_per_chunk([10.0, 26.0, 41.5], [10.0, 15.0, 15.0]) == pytest.approx([1.0, 0.5])
    assert table.outside_per_chunk([10.0], [10.0]) == []


def test_a_row_without_a_goal_shows_its_ratio_and_no_verdict():
    row = table.Row("save-to-commit with sha256 / durable copy", reference=2.0, ours=3.0, unit="s", goal_op="<=",
                    goal=None)
    assert row.ratio == pytest.approx(1.5) and row.met is None
    assert row.cells()[3:] == ["1.50x", "-", "-"]


def test_extra_per_checkpoint_is_the_wall_difference_over_the_extra_checkpoints():
    # 5 checkpoints took 130 s, the same run with 1 took 122 s: 2 s per extra checkpoint
    assert table.extra_per_checkpoint(130.0, 122.0, 5, 1) == pytest.approx(2.0)
    assert table.extra_per_checkpoint(121.0, 122.0, 3, 1) == pytest.approx(-0.5)  # noise shows as it is
    assert table.extra_per_checkpoint(130.0, 122.0, 1, 1) is None
