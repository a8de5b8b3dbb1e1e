"""Figures as inline SVG, so a report is one file that opens anywhere without a network.

matplotlib draws text as paths by default, so the SVG needs no fonts either.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

_COLORS = {"win": "#2e7d32", "draw": "#9e9e9e", "loss": "#c62828", "invalid": "#6a1b9a", "model": "#1565c0"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "svg.hashsalt": "blackjack-rl",  # stable element ids: the same run gives the same file
        "font.size": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
    })
    return plt


def to_svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def reward_vs_baselines(mean: float | None, low: float | None, high: float | None,
                        references: dict[str, float], label: str) -> str:
    """The model's mean reward with its 95% interval on the same axis as the exact baselines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 1.9))
    values = [v for v in references.values()] + [v for v in (low, high, mean) if v is not None]
    lo, hi = min(values + [-1.0 if mean is not None and mean < -0.5 else -0.5]), max(values + [0.05])
    ax.set_xlim(lo - 0.05, hi + 0.05)
    ax.set_ylim(-0.6, 1.1)
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    for i, (name, v) in enumerate(references.items()):
        ax.axvline(v, color="#888", lw=1, ls="--")
        ax.text(v, 0.95 - 0.3 * (i % 2), f" {name.replace('_', ' ')}\n {v:+.4f}", fontsize=8, color="#555", va="top")
    if mean is not None:
        ax.errorbar([mean], [0], xerr=[[mean - low], [high - mean]], fmt="o", color=_COLORS["model"],
                    capsize=5, lw=2, ms=7)
        ax.text(mean, -0.35, f"{label}: {mean:+.4f}  [{low:+.4f}, {high:+.4f}]", ha="center", fontsize=8.5,
                color=_COLORS["model"])
    ax.set_xlabel("mean reward per hand (exact values for the baselines, 95% CI for the model)")
    return to_svg(fig)


def outcome_bars(rows: Sequence[tuple[str, dict[str, float]]]) -> str:
    """Win / draw / loss / invalid shares, one stacked bar per player."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 0.45 * len(rows) + 0.7))
    names = [name for name, _ in rows][::-1]
    left = [0.0] * len(rows)
    for part in ("win", "draw", "loss", "invalid"):
        widths = [shares.get(part, 0.0) for _, shares in rows][::-1]
        bars = ax.barh(names, widths, left=left, color=_COLORS[part], label=part, height=0.6)
        for bar, w in zip(bars, widths):
            if w >= 0.06:
                ax.text(bar.get_x() + w / 2, bar.get_y() + bar.get_height() / 2, f"{w:.0%}", ha="center",
                        va="center", color="white", fontsize=8)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    ax.legend(ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize=8)
    return to_svg(fig)


def paired_forest(items: Sequence[dict[str, Any]]) -> str:
    """Paired differences with their 95% intervals, one line per comparison and quantity."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 0.42 * len(items) + 0.8))
    labels = [it["label"] for it in items][::-1]
    for y, it in enumerate(items[::-1]):
        color = "#2e7d32" if it["good"] else "#c62828" if it["significant"] else "#777"
        ax.errorbar([it["mean"]], [y], xerr=[[it["mean"] - it["low"]], [it["high"] - it["mean"]]], fmt="o",
                    color=color, capsize=4, lw=2)
    ax.axvline(0, color="#333", lw=1)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("paired difference, later run minus baseline (95% CI); green = better, red = worse, grey = luck")
    return to_svg(fig)
