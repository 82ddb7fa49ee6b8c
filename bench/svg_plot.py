"""A dependency-free line chart as SVG (the project does not need matplotlib for one figure)."""

from __future__ import annotations

import math
from pathlib import Path

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def line_chart(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    log2_x: bool = True,
    width: int = 640,
    height: int = 400,
) -> Path:
    """Write `series` (label -> [(x, y), ...]) as a line chart with axes, ticks and a legend."""
    left, right, top, bottom = 60, 170, 40, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]

    def fx(x: float) -> float:
        lo, hi = (math.log2(min(xs)), math.log2(max(xs))) if log2_x else (min(xs), max(xs))
        v = math.log2(x) if log2_x else x
        return left + (v - lo) / ((hi - lo) or 1.0) * (width - left - right)

    y_lo, y_hi = 0.0, max(ys) * 1.1

    def fy(y: float) -> float:
        return top + (1 - (y - y_lo) / ((y_hi - y_lo) or 1.0)) * (height - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{left}" y1="{fy(y_lo)}" x2="{width - right}" y2="{fy(y_lo)}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{fy(y_lo)}" stroke="black"/>',
        f'<text x="{(left + width - right) / 2}" y="{height - 10}" text-anchor="middle">{xlabel}</text>',
        f'<text x="15" y="{height / 2}" text-anchor="middle" transform="rotate(-90 15 {height / 2})">{ylabel}</text>',
    ]
    for x in sorted(set(xs)):
        out.append(f'<text x="{fx(x)}" y="{fy(y_lo) + 16}" text-anchor="middle">{x:g}</text>')
    for k in range(6):
        y = y_lo + (y_hi - y_lo) * k / 5
        out.append(f'<text x="{left - 6}" y="{fy(y) + 4}" text-anchor="end">{y:.2f}</text>')
        out.append(f'<line x1="{left}" y1="{fy(y)}" x2="{width - right}" y2="{fy(y)}" stroke="#ddd"/>')
    for i, (label, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        d = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="3" fill="{color}"/>' for x, y in pts]
        ly = top + 20 * i
        out.append(
            f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 30}" y2="{ly}" stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{width - right + 35}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))
    return path
