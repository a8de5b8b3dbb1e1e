"""Figures as small inline SVG written by hand, so a report is one file that opens anywhere.

Three simple shapes cover every figure (a number line with intervals, stacked bars, a
forest of paired differences), and drawing them directly keeps a plotting library's
import time (seconds) out of every `evaluate` and `compare`.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Sequence

COLOURS = {"win": "#2e7d32", "draw": "#9e9e9e", "loss": "#c62828", "invalid": "#6a1b9a", "model": "#1565c0",
           "better": "#2e7d32", "worse": "#c62828", "luck": "#757575"}
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif"'


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = first
    while v <= hi + 1e-9 * step:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="{escape(label)}" {_FONT} font-size="11">'
            + "".join(body) + "</svg>")


def _text(x: float, y: float, text: str, anchor: str = "start", colour: str = "#444", size: int = 11,
          weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{colour}" font-size="{size}" '
            f'font-weight="{weight}">{escape(text)}</text>')


def _axis(x0: float, x1: float, y: float, lo: float, hi: float, fmt: str) -> list[str]:
    scale = (x1 - x0) / (hi - lo)
    out = [f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#555"/>']
    for t in nice_ticks(lo, hi):
        x = x0 + (t - lo) * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#555"/>')
        out.append(_text(x, y + 15, format(t or 0.0, fmt), "middle", "#555", 10))  # no "-0.00"
    return out


def reward_vs_baselines(mean: float | None, low: float | None, high: float | None,
                        references: dict[str, float], label: str) -> str:
    """The model's mean reward with its 95% interval on the same axis as the exact baselines."""
    width, height, x0, x1 = 600, 150, 20, 580
    values = list(references.values()) + [v for v in (low, high, mean) if v is not None]
    lo, hi = min(values) - 0.05, max(values) + 0.05
    scale = (x1 - x0) / (hi - lo)
    px = lambda v: x0 + (v - lo) * scale  # noqa: E731
    body = []
    for i, (name, v) in enumerate(sorted(references.items(), key=lambda kv: kv[1])):
        x = px(v)
        y = 14 + 24 * (i % 2)
        body.append(f'<line x1="{x:.1f}" y1="{y + 4}" x2="{x:.1f}" y2="112" stroke="#999" stroke-dasharray="4 3"/>')
        body.append(_text(x, y, f"{name.replace('_', ' ')} {v:+.4f}", "middle", "#555", 10))
    if mean is not None and low is None:  # too few deals for an interval: the point alone
        m, c = px(mean), COLOURS["model"]
        body.append(f'<circle cx="{m:.1f}" cy="78" r="5.5" fill="{c}"/>')
        anchor = "start" if m < x0 + 120 else "end" if m > x1 - 120 else "middle"
        body.append(_text(m, 102, f"{label}: {mean:+.4f} (too few deals for a CI)", anchor, c, 11, "600"))
    elif mean is not None:
        a, b, m = px(low), px(high), px(mean)
        c = COLOURS["model"]
        body.append(f'<line x1="{a:.1f}" y1="78" x2="{b:.1f}" y2="78" stroke="{c}" stroke-width="2.5"/>')
        body += [f'<line x1="{x:.1f}" y1="71" x2="{x:.1f}" y2="85" stroke="{c}" stroke-width="2"/>' for x in (a, b)]
        body.append(f'<circle cx="{m:.1f}" cy="78" r="5.5" fill="{c}"/>')
        anchor = "start" if m < x0 + 120 else "end" if m > x1 - 120 else "middle"
        body.append(_text(m, 102, f"{label}: {mean:+.4f} [{low:+.4f}, {high:+.4f}]", anchor, c, 11, "600"))
    body += _axis(x0, x1, 118, lo, hi, "+.2f")
    body.append(_text((x0 + x1) / 2, 146, "mean reward per hand: exact for the baselines, 95% CI for the model",
                      "middle", "#666", 10))
    return _svg(width, height, body, "mean reward against the baselines")


def outcome_bars(rows: Sequence[tuple[str, dict[str, float]]]) -> str:
    """Win / draw / loss / invalid shares, one stacked bar per player."""
    label_w, bar_w, row_h = 120, 460, 26
    width, height = label_w + bar_w + 10, 28 + row_h * len(rows) + 6
    body = []
    x = label_w
    for part in ("win", "draw", "loss", "invalid"):
        body.append(f'<rect x="{x}" y="4" width="10" height="10" fill="{COLOURS[part]}"/>')
        body.append(_text(x + 14, 13, part, colour="#555", size=10))
        x += 70
    for i, (name, shares) in enumerate(rows):
        y = 24 + i * row_h
        short = name if len(name) <= 16 else name[:15] + "…"
        body.append(_text(label_w - 8, y + 15, short, "end", "#333"))
        left = 0.0
        for part in ("win", "draw", "loss", "invalid"):
            w = max(0.0, shares.get(part, 0.0))
            if w <= 0:
                continue
            xa = label_w + left * bar_w
            body.append(f'<rect x="{xa:.1f}" y="{y}" width="{w * bar_w:.1f}" height="{row_h - 6}" fill="{COLOURS[part]}">'
                        f'<title>{escape(name)}: {part} {w:.1%}</title></rect>')
            if w >= 0.07:
                body.append(_text(xa + w * bar_w / 2, y + 14, f"{w:.0%}", "middle", "#fff", 10))
            left += w
    return _svg(width, height, body, "outcome shares")


def paired_forest(items: Sequence[dict[str, Any]]) -> str:
    """Paired differences with their 95% intervals, one line per comparison and quantity."""
    label_w, plot_w, row_h = 290, 330, 24
    width, height = label_w + plot_w + 20, 12 + row_h * len(items) + 44
    values = [v for it in items for v in (it["low"], it["high"])] + [0.0]
    span = max(values) - min(values) or 1.0
    lo, hi = min(values) - 0.08 * span, max(values) + 0.08 * span
    x0, x1 = label_w, label_w + plot_w
    px = lambda v: x0 + (v - lo) * (x1 - x0) / (hi - lo)  # noqa: E731
    bottom = 12 + row_h * len(items)
    body = [f'<line x1="{px(0):.1f}" y1="4" x2="{px(0):.1f}" y2="{bottom}" stroke="#333"/>']
    for i, it in enumerate(items):
        y = 12 + i * row_h + row_h / 2
        c = COLOURS["better"] if it["good"] else COLOURS["worse"] if it["significant"] else COLOURS["luck"]
        body.append(_text(label_w - 10, y + 4, it["label"], "end", "#333"))
        body.append(f'<line x1="{px(it["low"]):.1f}" y1="{y}" x2="{px(it["high"]):.1f}" y2="{y}" stroke="{c}" stroke-width="2.5"/>')
        body += [f'<line x1="{px(v):.1f}" y1="{y - 6}" x2="{px(v):.1f}" y2="{y + 6}" stroke="{c}" stroke-width="2"/>'
                 for v in (it["low"], it["high"])]
        body.append(f'<circle cx="{px(it["mean"]):.1f}" cy="{y}" r="5" fill="{c}"/>')
    body += _axis(x0, x1, bottom + 4, lo, hi, "+.3f" if span < 0.2 else "+.2f")
    body.append(_text(width / 2, bottom + 36, "later run minus baseline, paired by deal (95% CI): "
                      "green better, red worse, grey luck", "middle", "#666", 10))
    return _svg(width, height, body, "paired differences")
