"""The goodput ledger's categories and the chunk's timers (`rlhf_core.ops.goodput_categories`): every timer counts
somewhere, every category is a field of a stage's record and of its summary, and the one mapping rule holds."""

from __future__ import annotations

from dataclasses import fields

from rlhf_core.ops.goodput import _new_stage
from rlhf_core.ops.goodput_categories import TIMER_CATEGORY, Category, Timer, category_shares
from rlhf_core.ops.goodput_summary import StageGoodput


def test_every_timer_has_a_category_and_every_category_a_field():
    assert set(TIMER_CATEGORY) == set(Timer)
    summary_fields = {field.name for field in fields(StageGoodput)}
    for category in Category:
        assert category.value in _new_stage() and category.value in summary_fields, category


def test_a_timer_that_another_overrides_or_that_is_part_of_another_is_counted_once():
    seconds = {"train": 9.0, "step_loop": 8.0, "eval": 1.0, "writer_slowdown": 0.5, "save_and_commit": 3.0,
               "stall": 0.25, "retries": 7.0}
    totals: dict[Category, float] = {}
    for category, share in category_shares(seconds):
        totals[category] = totals.get(category, 0.0) + share
    assert totals == {Category.USEFUL: 8.0 - 1.0 - 0.5, Category.EVAL: 1.0, Category.STALL: 0.5 + 0.25}
