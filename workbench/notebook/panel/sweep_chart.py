"""The Sweep tab's overlay: one metric's curves of every member on one chart, as inline SVG.

An SVG string rather than a matplotlib canvas: the chart is redrawn whole (an HTML widget's value), so
its bytes are what a redraw costs the page, and they are bounded by construction: each line is thinned
to at most `MAX_POINTS` points (every k-th, the last kept), one point a few bytes, so a chart of N members
sends at most ~N × 1.5 KB whatever the sweep's length. The same string is the saved record's chart
(`workbench.notebook.panel.record`): plain HTML that a notebook without its kernel still shows. NaN
values break a member's line (a diverged step shows as a gap), as the Metrics tab's plots do.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence

PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""Matplotlib's tab10: member k is drawn in `PALETTE[k % 10]`, in the table and the legend alike."""

MAX_POINTS = 120
"""The most points a member's line is drawn with (a chart is 300 px wide: more points add bytes, not
shape)."""

WIDTH, HEIGHT = 340, 200
"""One chart's size in px (the Metrics tab's plot is 340 × 260)."""
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 18, 22
"""The margins, in px, around the plotting area: the y labels on the left, the x labels below."""


@dataclasses.dataclass(frozen=True)
class ChartLine:
    """One member's curve: its name, colour and points (optimizer step, value)."""

    name: str
    colour: str
    steps: Sequence[int]
    values: Sequence[float]


def thinned(
    steps: Sequence[int], values: Sequence[float], limit: int = MAX_POINTS
) -> list[tuple[int, float]]:
    """At most `limit` of the points: every k-th (k = ceil(n / limit)), and the last one always."""
    points = list(zip(steps, values, strict=True))
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    kept = points[::stride]
    if kept[-1] != points[-1]:
        kept[-1] = points[-1]
    return kept


def _label(value: float) -> str:
    return f"{value:.4g}"


def overlay_svg(title: str, lines: Sequence[ChartLine]) -> str:
    """An SVG chart of `title` with one `<g class="wb-sweep-line">` per line (its `data-member` the
    line's name), the y axis from the least to the greatest finite value, the x axis over the steps."""
    shown = [(line, thinned(line.steps, line.values)) for line in lines]
    finite = [(x, y) for _, points in shown for x, y in points if math.isfinite(y)]
    head = (
        f'<svg class="wb-sweep-chart" data-metric="{html.escape(title)}" width="{WIDTH}" height="{HEIGHT}"'
        f' viewBox="0 0 {WIDTH} {HEIGHT}" style="font:10px sans-serif">'
        f'<text x="{LEFT}" y="12" font-weight="bold">{html.escape(title)}</text>'
    )
    if not finite:
        return head + f'<text x="{LEFT}" y="{HEIGHT // 2}" fill="#888">no values yet</text></svg>'
    x_low, x_high = min(x for x, _ in finite), max(x for x, _ in finite)
    y_low, y_high = min(y for _, y in finite), max(y for _, y in finite)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    if y_high == y_low:
        pad = abs(y_low) * 0.05 or 1.0
        y_low, y_high = y_low - pad, y_high + pad
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float, y: float) -> str:
        return (
            f"{LEFT + (x - x_low) / (x_high - x_low) * inner_w:.1f},"
            f"{TOP + (y_high - y) / (y_high - y_low) * inner_h:.1f}"
        )

    parts = [
        head,
        f'<rect x="{LEFT}" y="{TOP}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#ccc"/>',
        f'<text x="{LEFT - 3}" y="{TOP + 8}" text-anchor="end">{_label(y_high)}</text>',
        f'<text x="{LEFT - 3}" y="{TOP + inner_h}" text-anchor="end">{_label(y_low)}</text>',
        f'<text x="{LEFT}" y="{HEIGHT - 8}">{_label(x_low)}</text>',
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 8}" text-anchor="end">step {_label(x_high)}</text>',
    ]
    for line, points in shown:
        segments: list[list[tuple[int, float]]] = [[]]
        for x, y in points:
            if math.isfinite(y):
                segments[-1].append((x, y))
            elif segments[-1]:
                segments.append([])
        drawn = "".join(
            f'<circle cx="{px(*seg[0]).split(",")[0]}" cy="{px(*seg[0]).split(",")[1]}" r="2"/>'
            if len(seg) == 1
            else f'<polyline fill="none" stroke-width="1.5" points="{" ".join(px(x, y) for x, y in seg)}"/>'
            for seg in segments
            if seg
        )
        parts.append(
            f'<g class="wb-sweep-line" data-member="{html.escape(line.name)}" stroke="{line.colour}"'
            f' fill="{line.colour}"><title>{html.escape(line.name)}</title>{drawn}</g>'
        )
    return "".join(parts) + "</svg>"
