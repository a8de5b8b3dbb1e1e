"""The exact strategy chart of a policy as a page: P(hit) per state beside the optimal action.

The colour of a cell is the policy's probability of hitting (blue: hit, orange: stick); a
cell whose colour disagrees with the optimal action's letter is a mistake, and how strongly
it disagrees is how costly it is on average. The numbers above the chart are exact (grid.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from blackjack_rl.measure.grid import GridEvaluation
from blackjack_rl.game.solver import DEALER_CARDS, HARD_SUMS, HIT, SOFT_SUMS, Solution
from blackjack_rl.outputs import write_text
from blackjack_rl.report.html import environment


def grid_rows(evaluation: GridEvaluation | Mapping[str, Any], solution: Solution) -> list[dict[str, Any]]:
    """One row per chart line (hard 4..21, then soft 12..21): its label and its cells."""
    table = evaluation.p_hit if isinstance(evaluation, GridEvaluation) else evaluation["p_hit"]
    labels = [(s, False) for s in HARD_SUMS] + [(s, True) for s in SOFT_SUMS]
    rows = []
    for (s, soft), values in zip(labels, table):
        cells = []
        for d, p in zip(DEALER_CARDS, values):
            optimal = solution.best_action((s, d, soft))
            cells.append({
                "p_hit": p,
                "optimal": "H" if optimal == HIT else "S",
                "p_right": p if optimal == HIT else 1.0 - p,
            })
        rows.append({"label": f"{'soft' if soft else 'hard'} {s}", "cells": cells})
    return rows


def render_grid_page(title: str, evaluation: GridEvaluation, solution: Solution, meta: Mapping[str, Any]) -> str:
    g = {**evaluation.to_dict(), "whole_game": meta.get("whole_game")}
    return environment().get_template("grid.html.jinja").render(
        title=title, g=g, rows=grid_rows(evaluation, solution),
        dealers=["A" if d == 1 else str(d) for d in DEALER_CARDS], meta=dict(meta),
    )


def write_grid_page(path: Path, title: str, evaluation: GridEvaluation, solution: Solution,
                    meta: Mapping[str, Any]) -> Path:
    return write_text(path, render_grid_page(title, evaluation, solution, meta))
