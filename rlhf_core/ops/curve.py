"""A stage's metrics per committed chunk drawn as SVG text, one panel per metric group: the curve of the stage
report, without matplotlib (whose import and first figure cost the driver ~0.7 CPU-s a command). Lines with a
marker at each committed chunk, a title, a step axis, a few value ticks and a legend; a browser, the Prefect UI
(as a data URI) and any image viewer show it.
"""

from __future__ import annotations

import math
from html import escape

# One panel per group present, in this order (PPO reports reward, SFT and RM a loss; eval metrics when asked
# for): the last step's value beside the chunk's mean.
CURVE_PANELS = (("loss", "mean_loss"), ("reward", "mean_reward"), ("eval_loss",), ("eval_accuracy",),
                ("eval_reward",), ("kl",))
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
PANEL_WIDTH, HEIGHT = 450, 320
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 30, 42  # the plot area's margins in a panel


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def curve_svg(stage: str, rows: list[dict]) -> bytes:
    """The stage's metrics per committed chunk (`rows`: dicts with "step" and metric values), as SVG bytes;
    no rows or no metric yet: one empty panel."""
    panels = [[name for name in panel if any(finite(row.get(name)) for row in rows)] for panel in CURVE_PANELS]
    panels = [panel for panel in panels if panel] or [[]]
    width = PANEL_WIDTH * len(panels)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT}" '
             f'viewBox="0 0 {width} {HEIGHT}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{HEIGHT}" fill="white"/>']
    for index, panel in enumerate(panels):
        series = {name: [(row["step"], row[name]) for row in rows if finite(row.get(name)) and finite(row.get("step"))]
                  for name in panel}
        title = f"{stage}: {panel[0]}" if panel else stage
        parts.append(_panel(index * PANEL_WIDTH, title, series))
    parts.append("</svg>")
    return "\n".join(parts).encode()


def _panel(x0: int, title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """One panel at `x0`: frame, title, ticks, a polyline and markers per series, and the legend."""
    left, top, right, bottom = x0 + LEFT, TOP, x0 + PANEL_WIDTH - RIGHT, HEIGHT - BOTTOM
    points = [point for values in series.values() for point in values]
    steps = _span([step for step, _ in points])
    values = _span([value for _, value in points])

    def at(step: float, value: float) -> str:
        x = left + (step - steps[0]) / (steps[1] - steps[0]) * (right - left)
        y = bottom - (value - values[0]) / (values[1] - values[0]) * (bottom - top)
        return f"{x:.1f},{y:.1f}"

    out = [f'<text x="{(left + right) / 2:.0f}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#444"/>',
           f'<text x="{(left + right) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">step</text>']
    for tick in _ticks(*steps):
        x = at(tick, values[0]).split(",")[0]
        out.append(f'<line x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 4}" stroke="#444"/>'
                   f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{tick:g}</text>')
    for tick in _ticks(*values):
        y = at(steps[0], tick).split(",")[1]
        out.append(f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#ddd"/>'
                   f'<text x="{left - 5}" y="{y}" text-anchor="end" dominant-baseline="middle">{tick:.4g}</text>')
    for number, (name, line) in enumerate(series.items()):
        color = COLORS[number % len(COLORS)]
        coordinates = " ".join(at(step, value) for step, value in line)
        out.append(f'<polyline points="{coordinates}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out += [f'<circle cx="{xy.split(",")[0]}" cy="{xy.split(",")[1]}" r="3" fill="{color}"/>'
                for xy in coordinates.split()]
        legend_y = top + 14 + 14 * number
        out.append(f'<line x1="{right - 90}" y1="{legend_y}" x2="{right - 74}" y2="{legend_y}" stroke="{color}" '
                   f'stroke-width="2"/><text x="{right - 70}" y="{legend_y}" dominant-baseline="middle">'
                   f'{escape(name)}</text>')
    return "\n".join(out)


def _span(numbers: list[float]) -> tuple[float, float]:
    """(low, high) of `numbers`, padded by 5%; never empty or zero-width."""
    if not numbers:
        return 0.0, 1.0
    low, high = min(numbers), max(numbers)
    pad = (high - low) * 0.05 or max(abs(low) * 0.05, 0.5)
    return low - pad, high + pad


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values between `low` and `high`, about `count` of them."""
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(factor * magnitude for factor in (1, 2, 5, 10) if factor * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step) + 1)]
