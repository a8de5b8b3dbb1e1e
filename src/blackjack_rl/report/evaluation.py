"""The evaluation report: one self-contained HTML page per `evaluate` run (OUT/report.html).

Written for someone who never saw the project: what was measured, how it compares with
exact optimal play and the simple baselines, where the strategy differs from the
optimal chart and which mistakes cost the most, and real episodes to look at.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Iterable

from blackjack_rl.outputs import write_text
from blackjack_rl.contract.records import Metrics, SampleRow
from blackjack_rl.game.solver import Solution, solve
from blackjack_rl.report import plots
from blackjack_rl.report.episodes import compact, invalid_examples, sample
from blackjack_rl.report.html import accuracy_colour, cost_colour, environment, hit_colour
from blackjack_rl.report.modes import decoding_mode, policy_name
from blackjack_rl.report.strategy import chart, costliest, state_stats

EPISODE_SAMPLE = 400


def run_name(metrics: Metrics) -> str:
    return policy_name(metrics.policy)


def reading(metrics: Metrics) -> str:
    """Where the mean reward sits among the baselines, taking its interval into account."""
    mr = metrics.mean_reward
    if mr.mean is None:
        return "No episode finished, so there is no mean reward to compare."
    low, high = mr.ci95_low, mr.ci95_high
    if low is None:
        return (f"Mean reward {mr.mean:+.4f} over {metrics.episodes_played} deals: too few deals for a 95% "
                "interval, so no comparison with the baselines; evaluate more episodes.")
    ref = metrics.reference
    parts = []
    for name, label in (("optimal", "optimal play"), ("always_stick", "always sticking"), ("random", "uniform random play")):
        v = ref[name].value
        if high < v:
            parts.append(f"below {label} ({v:+.4f})")
        elif low > v:
            parts.append(f"above {label} ({v:+.4f})")
        else:
            parts.append(f"not distinguishable from {label} ({v:+.4f})")
    n = metrics.episodes_played
    return (f"Mean reward {mr.mean:+.4f} (95% CI {low:+.4f} to {high:+.4f}, {n} deals): "
            + "; ".join(parts) + ".")


def report_context(metrics: Metrics, rows: list[SampleRow], solution: Solution) -> dict[str, Any]:
    stats, episodes = state_stats(rows)
    hard = chart(stats, solution, episodes, soft=False)
    soft = chart(stats, solution, episodes, soft=True)
    cells = [c for grid in (hard, soft) for row in grid for c in row]
    worst = max((c.cost_per_hand for c in cells), default=0.0)
    max_decisions = max((c.decisions for c in cells), default=0) or 1
    ref = metrics.reference
    mr = metrics.mean_reward
    name = run_name(metrics)
    n = metrics.episodes_played or 1
    invalid_share = metrics.invalid.rate or 0.0
    outcome_rows = [(name, {"win": metrics.win.rate or 0.0, "draw": metrics.draw.rate or 0.0,
                            "loss": metrics.loss.rate or 0.0, "invalid": invalid_share})]
    for key, label in (("optimal", "optimal"), ("always_stick", "always stick"), ("random", "uniform random")):
        outcome_rows.append((label, {"win": ref[key].win, "draw": ref[key].draw, "loss": ref[key].loss}))
    system_prompts: list[str] = []
    browsable = [compact(r, system_prompts) for r in sample(rows, EPISODE_SAMPLE)]
    params = metrics.policy
    return {
        "title": f"How {name} plays Blackjack",
        "name": name,
        "m": metrics,
        "mode": decoding_mode(params),
        "params_json": json.dumps(params, indent=1),
        "rules_text": solution.rules.describe(),
        "generated": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "reading": reading(metrics),
        "reward_svg": plots.reward_vs_baselines(
            mr.mean, mr.ci95_low, mr.ci95_high,
            {"optimal": ref["optimal"].value, "always_stick": ref["always_stick"].value,
             "random": ref["random"].value}, name),
        "outcome_svg": plots.outcome_bars(outcome_rows),
        "charts": [("Hard hands", "hard", hard), ("Soft hands (an ace counted as 11)", "soft", soft)],
        "hit_colour": hit_colour,
        "accuracy_colour": accuracy_colour,
        "cost_colour": lambda c: cost_colour(c, worst),
        "max_decisions": max_decisions,
        "worst_cost": worst,
        "costliest": costliest(cells),
        "invalid_examples": invalid_examples(rows),
        "episodes_json": {"system": system_prompts, "episodes": browsable},
        "sample_size": len(browsable),
        "n": n,
        **_grid_context(metrics, solution),
    }


def _grid_context(metrics: Metrics, solution: Solution) -> dict[str, Any]:
    """The exact chart, when `evaluate --grid` measured it."""
    from blackjack_rl.game.solver import DEALER_CARDS
    from blackjack_rl.report.gridpage import grid_rows

    g = metrics.grid
    if not g:
        return {"grid": None}
    return {"grid": g, "grid_rows": grid_rows(g, solution),
            "grid_dealers": ["A" if d == 1 else str(d) for d in DEALER_CARDS]}


def render_report(metrics: Metrics, rows: Iterable[SampleRow], solution: Solution | None = None) -> str:
    rows = list(rows)
    if solution is None:
        solution = solve(metrics.rules)
    return environment().get_template("report.html.jinja").render(**report_context(metrics, rows, solution))


def write_report(path: Path, metrics: Metrics, rows: Iterable[SampleRow],
                 solution: Solution | None = None) -> Path:
    return write_text(path, render_report(metrics, rows, solution))
