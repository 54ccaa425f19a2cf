"""The stage report's curve as SVG (rlhf_core/ops/curve.py), drawn without matplotlib: one panel per metric group
present, a line and a marker per committed chunk of each metric, steps left to right, larger values higher."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ElementTree

from rlhf_core.ops.curve import curve_svg

SVG = "{http://www.w3.org/2000/svg}"


def parse(stage: str, rows: list[dict]):
    return ElementTree.fromstring(curve_svg(stage, rows))


def test_one_panel_per_metric_group_with_a_point_per_committed_value():
    rows = [{"step": 5, "loss": 2.5, "mean_loss": 2.7}, {"step": 10, "loss": 2.1, "mean_loss": float("nan")},
            {"step": 15, "loss": 1.8, "eval_loss": 2.0, "mean_loss": 2.0}, {"step": 20, "loss": None}]
    svg = parse("sft", rows)
    titles = [text.text for text in svg.iter(f"{SVG}text") if text.text and text.text.startswith("sft:")]
    assert titles == ["sft: loss", "sft: eval_loss"]
    assert float(svg.get("width")) == 2 * float(parse("sft", rows[:1]).get("width"))
    lines = [[tuple(map(float, xy.split(","))) for xy in line.get("points").split()]
             for line in svg.iter(f"{SVG}polyline")]
    assert [len(line) for line in lines] == [3, 2, 1]  # loss, mean_loss (its NaN left out), eval_loss
    loss = lines[0]
    assert loss[0][0] < loss[1][0] < loss[2][0]  # steps 5, 10, 15 left to right
    assert loss[0][1] < loss[1][1] < loss[2][1]  # a falling loss goes down (SVG's y grows downwards)
    assert len(list(svg.iter(f"{SVG}circle"))) == 6
    assert all(math.isfinite(x) and math.isfinite(y) for line in lines for x, y in line)


def test_nothing_committed_yet_or_one_point_draws_without_error():
    assert [t.text for t in parse("rm", []).iter(f"{SVG}text")][0] == "rm"  # an empty panel
    one = parse("ppo", [{"step": 8, "reward": 0.25}])
    (line,) = one.iter(f"{SVG}polyline")
    x, y = map(float, line.get("points").split(","))
    assert 0 < x < float(one.get("width")) and 0 < y < float(one.get("height"))


def test_metric_names_are_escaped():
    svg = curve_svg("a<b", [{"step": 1, "loss": 1.0}])
    assert b"a&lt;b" in svg and ElementTree.fromstring(svg) is not None
