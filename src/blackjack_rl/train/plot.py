"""The training curves as one PNG: what a person looks at to see whether it learned."""

from __future__ import annotations

import json
from dataclasses import dataclass
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


def _value_references(ax: Any) -> None:
    """The optimal policy's and always-stick's exact values (default rules), as the charts' value
    is read against them."""
    from blackjack_rl.game.solver import baselines

    ref = baselines()
    ax.axhline(ref["optimal"].value, color="gray", linestyle="--", linewidth=1, label="optimal")
    ax.axhline(ref["always_stick"].value, color="gray", linestyle=":", linewidth=1, label="always stick")


def _grid_panels(axes: Any, grid: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    """The exact strategy chart over training: accuracy and value, and the hit gap whose
    shrinking is what collapse to one constant action looks like."""
    xs = [r["step"] for r in grid]
    left, right = axes
    left.plot(xs, [r["grid_accuracy"] for r in grid], "o-", color="tab:green", label="accuracy (by visits)")
    left.set_ylim(0, 1)
    twin = left.twinx()
    twin.plot(xs, [r["grid_value"] for r in grid], "s-", color="tab:purple", label="expected return")
    _value_references(twin)
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


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend: the curves are written, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, png_path: Path, title: str) -> Path:
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    _pyplot().close(fig)
    return png_path


def plot_log(log_path: Path, png_path: Path, title: str = "") -> Path:
    plt = _pyplot()
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
    return _save(fig, png_path, title)


@dataclass(frozen=True)
class ChartPoint:
    """One exact chart of a run, placed by the training minutes spent before it."""

    minutes: float
    step: int  # the step within its phase
    phase: int  # 0-based index of the phase's log
    accuracy: float
    value: float


def chart_curve(logs: list[Path], scale: float = 1.0) -> list[ChartPoint]:
    """The exact charts of a run whose phases wrote `logs`, in order, on one axis of training
    minutes: the sum of the steps' own seconds (sampling and update; the charts are not
    counted), which a resumed phase does not reset as it does `elapsed`, times `scale`."""
    points: list[ChartPoint] = []
    spent = 0.0
    for phase, log in enumerate(logs):
        for row in _rows(log):
            if row.get("kind") == "step":
                spent += row["seconds"]
            if row.get("grid_accuracy") is not None:
                points.append(ChartPoint(scale * spent / 60, row["step"], phase, row["grid_accuracy"],
                                         row["grid_value"]))
    return points


def phase_minutes(log: Path) -> tuple[int, float]:
    """A phase's steps and training minutes."""
    steps = [row for row in _rows(log) if row.get("kind") == "step"]
    return len(steps), sum(row["seconds"] for row in steps) / 60


def first_phase_scales(runs: dict[str, list[Path]]) -> dict[str, float]:
    """Per run, the factor that puts its minutes on the first run's machine, measured on a first
    phase the runs share (same settings and seed, so the same work): runs made on different
    machines then compare at equal compute."""
    reference = next(iter(runs.values()))
    steps0, minutes0 = phase_minutes(reference[0])
    scales = {}
    for label, logs in runs.items():
        steps, minutes = phase_minutes(logs[0])
        if steps != steps0 or not minutes:
            raise ValueError(f"{label}: its first phase has {steps} steps ({minutes:.2f} minutes), the first run's "
                             f"{steps0}: calibrating needs the same first phase, timed")
        scales[label] = minutes0 / minutes
    return scales


def plot_chart_curves(runs: dict[str, list[Path]], png_path: Path, title: str = "",
                      scales: dict[str, float] | None = None) -> Path:
    """Runs side by side by training minutes (each times its `scales` entry): the exact chart's
    accuracy and value, with the optimal and always-stick values for reference. Equal compute
    reads off one vertical line."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.9))
    for label, logs in runs.items():
        points = chart_curve(logs, (scales or {}).get(label, 1.0))
        xs = [p.minutes for p in points]
        left.plot(xs, [p.accuracy for p in points], "o-", markersize=3, label=label)
        right.plot(xs, [p.value for p in points], "o-", markersize=3, label=label)
    left.set_ylim(0, 1)
    left.set_title("exact chart accuracy (by visits)", fontsize=10)
    _value_references(right)
    right.set_title("exact value of the chart at T = 1", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("training minutes (charts not counted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, png_path, title)


def run_logs(folder: Path) -> list[Path]:
    """A run's phase logs in order: a recipe run's NN-NAME/train_log.jsonl, or one training folder's log."""
    logs = sorted(folder.glob("[0-9][0-9]-*/train_log.jsonl"))
    if not logs and (folder / "train_log.jsonl").is_file():
        logs = [folder / "train_log.jsonl"]
    if not logs:
        raise FileNotFoundError(f"{folder} holds no train_log.jsonl (a recipe run or a train --out folder)")
    return logs


def main(argv: list[str] | None = None) -> int:
    """`python -m blackjack_rl.train.plot --out PNG LABEL=RUN ...`: runs' exact charts side by side
    by training minutes (how the docs compare recipes at equal compute)."""
    import sys

    from blackjack_rl.cli_options import Parser

    parser = Parser(prog="python -m blackjack_rl.train.plot", description=main.__doc__)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN", help="a label and a recipe run or train --out folder")
    parser.add_argument("--out", type=Path, required=True, metavar="PNG")
    parser.add_argument("--title", default="")
    parser.add_argument("--calibrate", action="store_true",
                        help="the runs share their first phase (same settings and seed) but ran on different "
                             "machines: put every run's minutes on the first run's machine by that phase's time")
    args = parser.parse_args(argv)
    try:
        runs = {}
        for item in args.runs:
            label, sep, folder = item.partition("=")
            if not sep or not label or not folder:
                raise ValueError(f"{item!r}: give each run as LABEL=FOLDER")
            runs[label] = run_logs(Path(folder))
        scales = first_phase_scales(runs) if args.calibrate else None
        for label, factor in (scales or {}).items():
            print(f"{label}: minutes x {factor:.4f}")
        print(plot_chart_curves(runs, args.out, args.title, scales))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
