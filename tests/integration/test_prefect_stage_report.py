"""What the stage subflow shows an operator, without a server: the console progress line, the curve (SVG),
artifact keys, and when a run budget stops a stage (flows/stage_report.py, flows/pipeline.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from xml.etree import ElementTree

from flows.pipeline import _budget_reason
from flows.stage_report import artifact_key, curve_svg, progress_line


def test_progress_line_is_one_plain_line_with_bar_chunks_step_and_headline_metric():
    assert progress_line("sft", (4, 8), (32, 64), {"loss": 2.9712, "lr": 1e-3}) == \
        "sft [#####-----] 4/8 chunks  step 32/64  loss 2.971"
    assert progress_line("ppo", (3, 3), (48, 48), {"reward": 0.125, "loss": 4.0}) == \
        "ppo [##########] 3/3 chunks  step 48/48  reward 0.125"


def test_curve_is_an_svg_with_one_panel_per_metric_group_and_tolerates_missing_values():
    rows = [{"step": 8, "loss": 2.6, "mean_loss": 2.8}, {"step": 16, "loss": float("nan"), "eval_accuracy": 0.7},
            {"step": 24, "loss": 2.1, "mean_loss": 2.2, "eval_accuracy": 0.8}]
    svg = ElementTree.fromstring(curve_svg("rm", rows))
    assert svg.tag.endswith("svg") and svg.get("width") == str(2 * 450)  # two panels: loss (with mean_loss), eval_accuracy
    assert ElementTree.fromstring(curve_svg("sft", [])).get("width") == "450"  # nothing committed yet: one empty panel


def test_artifact_keys_take_lowercase_letters_digits_and_dashes_only():
    assert artifact_key("My_Run.v2", "sft", "chunks") == "my-run-v2-sft-chunks"


def test_budget_reason_names_the_spent_budget_and_nothing_when_none_is():
    assert _budget_reason(None, None) is None
    assert _budget_reason(1, None) is None
    assert "max_chunks_per_run" in _budget_reason(0, None)
    past, future = datetime.now(timezone.utc) - timedelta(seconds=1), datetime.now(timezone.utc) + timedelta(hours=1)
    assert "time_budget_minutes" in _budget_reason(None, past)
    assert _budget_reason(2, future) is None
