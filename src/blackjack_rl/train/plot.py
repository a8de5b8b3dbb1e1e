"""The training curves as one PNG: what a person looks at to see whether it learned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steps, evals = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            (evals if row.get("kind") == "eval" else steps).append(row)
    return [r for r in steps if r.get("kind") == "step"], evals


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _grid_panels(axes: Any, grid: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    """The exact strategy chart over training: accuracy and value, and the hit gap whose
    shrinking is what collapse to one constant action looks like."""
    xs = [r["step"] for r in grid]
    left, right = axes
    left.plot(xs, [r["grid_accuracy"] for r in grid], "o-", color="tab:green", label="accuracy (by visits)")
    left.set_ylim(0, 1)
    twin = left.twinx()
    twin.plot(xs, [r["grid_value"] for r in grid], "s-", color="tab:purple", label="expected return")
    twin.axhline(-0.0466, color="gray", linestyle="--", linewidth=1, label="optimal")
    twin.axhline(-0.1864, color="gray", linestyle=":", linewidth=1, label="always stick")
    left.set_title("exact strategy chart (no sampling)", fontsize=10)
    left.legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    left.grid(alpha=0.3)
    right.plot(xs, [r["grid_p_hit_hit_optimal"] for r in grid], "o-", color="tab:red",
               label="P(hit) where hit is optimal")
    right.plot(xs, [r["grid_p_hit_stick_optimal"] for r in grid], "o-", color="tab:blue",
               label="P(hit) where stick is optimal")
    alarms = [r["step"] for r in grid if r.get("collapse_alarm")]
    for a in alarms:
        right.axvline(a, color="black", alpha=0.3, linewidth=1)
    right.set_ylim(0, 1)
    right.set_title("hit probability by optimal action (a shrinking gap: collapse)", fontsize=10)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)


def _fidelity_panels(axes: Any, rows: list[dict[str, Any]]) -> None:
    """The step's credit against the exact A^pi (--fidelity-every): does it point the right way,
    and how much of it is noise."""
    xs = [r["step"] for r in rows]
    scores = [r["fidelity"]["scores"]["all"] for r in rows]

    def series(key: str) -> list[float]:
        return [float("nan") if s[key] is None else s[key] for s in scores]

    left, right = axes
    left.plot(xs, series("sign_clear"), "o-", color="tab:green", label="sign agrees (|A| >= 0.01)")
    left.plot(xs, series("sign_weighted"), "o--", color="tab:olive", label="sign agrees, |A|-weighted")
    left.plot(xs, series("correlation"), "s-", color="tab:purple", label="correlation")
    left.set_ylim(-0.05, 1.05)
    left.set_title(f"credit against the exact A^pi ({rows[0]['fidelity_of']})", fontsize=10)
    right.plot(xs, series("noise"), "o-", color="tab:red", label="noise (two draws)")
    right.plot(xs, series("bias"), "s-", color="tab:blue", label="bias")
    right.axhline(0.0, color="gray", linewidth=1)
    right.set_title("credit noise and bias", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _rolling(values: list[float | None], window: int) -> list[float | None]:
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def plot_log(log_path: Path, png_path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_log(log_path)
    grid = [r for r in _rows(log_path) if r.get("grid_accuracy") is not None]
    fidelity = [r for r in steps if r.get("fidelity")]
    n_rows = 2 + bool(grid) + bool(fidelity)
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 3.7 * n_rows), sharex=True)
    panels = [
        ("mean_score", None, "mean training score"),
        ("valid_call_rate", "valid_decisions", "valid tool calls (share of answers)"),
        ("decision_accuracy", "decision_accuracy", "decisions equal to the optimal action"),
        ("win_rate", "win", "win rate"),
    ]
    if steps and all(r.get("mean_score") is None for r in steps):  # groups of the two calls only: nothing sampled
        panels = [
            ("p_valid_call", "valid_decisions", "P(writing a call exactly) on the training states"),
            ("p_hit_hit_optimal", None, "P(hit) on training states where hit is optimal"),
            ("p_hit_stick_optimal", "decision_accuracy", "P(hit) on training states where stick is optimal"),
            ("win_rate", "win", "win rate"),
        ]
    xs = [r["step"] for r in steps]
    window = max(1, len(steps) // 10)
    for ax, (train_key, eval_key, label) in zip(axes.flat[:4], panels):
        ys = [r.get(train_key) for r in steps]
        if any(y is not None for y in ys):
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], ".", color="tab:blue", alpha=0.35,
                    label="training batch")
            ax.plot(xs, [y if y is not None else float("nan") for y in _rolling(ys, window)], "-", color="tab:blue",
                    label=f"training, mean of {window}")
        if eval_key is not None and evals:
            ex = [r["step"] for r in evals]
            mid = [r["summary"][eval_key]["rate"] for r in evals]
            lo = [max(0.0, m - r["summary"][eval_key]["ci95_low"]) for m, r in zip(mid, evals)]
            hi = [max(0.0, r["summary"][eval_key]["ci95_high"] - m) for m, r in zip(mid, evals)]
            n = evals[0]["summary"]["episodes"]
            ax.errorbar(ex, mid, yerr=[lo, hi], fmt="o-", color="tab:red", capsize=4,
                        label=f"evaluation, {n} fixed deals (95% CI)")
            reference = evals[-1]["summary"].get("reference") or {}
            if eval_key == "win":
                for name, style in (("optimal", "--"), ("always_stick", ":")):
                    if name in reference:
                        ax.axhline(reference[name]["win"], color="gray", linestyle=style, linewidth=1,
                                   label=f"{name.replace('_', ' ')} (exact)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if grid:
        _grid_panels(axes[2], grid, steps)
    if fidelity:
        _fidelity_panels(axes[-1], fidelity)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
