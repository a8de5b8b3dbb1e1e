"""`compare`: evaluation runs side by side, paired deal by deal (console table and compare.html)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from blackjack_rl.config import Settings
from blackjack_rl.measure.compare import Comparison, Run, compare_runs


@dataclass
class CompareRun:
    runs: list[Run]
    comparisons: list[Comparison]
    page: Path


def run_compare(paths: list[str], out: str | Path) -> CompareRun:
    from blackjack_rl.report.comparison import write_comparison
    from blackjack_rl.report.runs import load_runs

    runs = load_runs(paths)
    comparisons = compare_runs(runs)
    html, _ = write_comparison(out, runs, comparisons)
    return CompareRun(runs, comparisons, html)


def run_versus(runs: list[Settings], out: str | Path, evaluate: Callable[[Settings], Any]) -> CompareRun:
    """Evaluate each run (each writes to its own `out`) on the same fixed deals, then pair them
    against the first: a model beside its adapter, live."""
    for settings in runs:
        evaluate(settings)
    return run_compare([str(settings.out) for settings in runs], out)
