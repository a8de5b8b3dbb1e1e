"""The numbers a run logs: per step, read from the groups themselves; and of the current weights,
on the fixed evaluation deals and on the exact strategy chart.

Every group carries `episodes`, one record per sequence: for whole-episode groups the
actions taken and the optimal ones and the outcome; for step groups the one action and the
optimal one. That is all a trainer pulling from the API sees too, so local and API training
report the same way. An invalid answer counts as a wrong decision, as in `evaluate`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from blackjack_rl.config import Settings
from blackjack_rl.measure.evaluation import compute_metrics, rate_ci
from blackjack_rl.measure.grid import evaluate_grid
from blackjack_rl.measure.probe import exact_game, probe_policy
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import run_evaluation
from blackjack_rl.contract.records import (EpisodeRecord, Metrics, Outcome, ScoredDataGroup, SequenceRecord, Status,
                                           StepRecord)
from blackjack_rl.train.groups import decision_of, records_of


def _sampled(record: SequenceRecord | None) -> bool:
    # forced (counterfactual) answers were not sampled: they say nothing about the policy
    return not (isinstance(record, StepRecord) and record.forced)


def batch_metrics(groups: Sequence[ScoredDataGroup]) -> dict[str, Any]:
    pairs = [(float(s), r) for g in groups for s, r in zip(g.scores, records_of(g)) if _sampled(r)]
    scores = [s for s, _ in pairs]
    records = [r for _, r in pairs if r is not None]
    decisions = [d for r in records for d in r.choices]
    valid = sum(a is not None for a, _ in decisions)
    correct = sum(a is not None and a == o for a, o in decisions)
    finished = [r for r in records if isinstance(r, EpisodeRecord) and r.status != Status.FAILED]
    wins = sum(r.outcome == Outcome.WIN for r in finished)
    # counterfactual groups carry the policy's P(hit) among the two calls at their decision:
    # on the states the policy visits, an exact reading of its strategy with no extra cost
    p_hit: dict[str, list[float]] = {"hit": [], "stick": []}
    p_valid = []
    for g in groups:
        first = decision_of(g)
        if first is None:
            continue
        if first.p_call and first.optimal in p_hit:
            p_hit[first.optimal].append(float(first.p_call["hit"]))
        if first.p_valid is not None:
            p_valid.append(float(first.p_valid))
    return {
        "groups": len(groups),
        "sequences": len(scores),
        "mean_score": sum(scores) / len(scores) if scores else None,
        "decisions": len(decisions),
        "valid_call_rate": valid / len(decisions) if decisions else None,
        "decision_accuracy": correct / len(decisions) if decisions else None,
        # whole-episode groups only: step groups score single decisions, not games
        "win_rate": wins / len(finished) if finished else None,
        "p_hit_hit_optimal": sum(p_hit["hit"]) / len(p_hit["hit"]) if p_hit["hit"] else None,
        "p_hit_stick_optimal": sum(p_hit["stick"]) / len(p_hit["stick"]) if p_hit["stick"] else None,
        "p_valid_call": sum(p_valid) / len(p_valid) if p_valid else None,  # P(writing one of the calls exactly)
    }


def eval_summary(metrics: Metrics) -> dict[str, Any]:
    """The headline numbers of an `evaluate` run, with their 95% intervals (JSON-ready)."""
    n = metrics.episodes_played
    invalid_k = sum(v.count for v in metrics.invalid_by_reason.values())
    return {
        "episodes": n,
        "valid_episodes": rate_ci(n - invalid_k, n).to_json(),  # every answer a valid call, the game played out
        "valid_decisions": rate_ci(metrics.valid_decisions, metrics.decisions).to_json(),
        "win": metrics.win.to_json(),
        "draw": metrics.draw.to_json(),
        "loss": metrics.loss.to_json(),
        "decision_accuracy": metrics.decision_accuracy.to_json(),
        "mean_reward": metrics.mean_reward.to_json(),
        "mean_regret": metrics.mean_regret.to_json(),
        # optimal, always stick, random: exact values and win rates
        "reference": {k: v.to_json() for k, v in metrics.reference.items()},
    }


def evaluate_policy(player: Player, settings: Settings, step: int, out: Path) -> dict[str, Any]:
    """The fixed evaluation deals, played by the current weights, with `evaluate`'s metrics
    (written to OUT/eval/step_NNNN.json); the log row of their summary."""
    t0 = time.perf_counter()
    episodes = asyncio.run(
        run_evaluation(player, settings.train.eval_episodes, settings.evaluate.concurrency)
    )
    metrics = compute_metrics(episodes, player)
    metrics.seconds = time.perf_counter() - t0
    (out / "eval").mkdir(parents=True, exist_ok=True)
    (out / "eval" / f"step_{step:04d}.json").write_text(json.dumps(metrics.to_json(), indent=2) + "\n",
                                                          encoding="utf-8")
    return {"kind": "eval", "step": step, "summary": eval_summary(metrics), "seconds": metrics.seconds}


def grid_metrics(player: Player, settings: Settings) -> dict[str, Any]:
    """The exact strategy-chart numbers of the current weights (measure/grid.py), and the
    whole-game value with its certified interval (measure/tree.py), as log fields.

    The whole game reads `train.game_budget` histories, its ~270 first decisions included (free:
    the chart reads them, with P(a canonical call), a third more work). Those after a hit cost
    about a chart cell each; for a model that plays well the interval stays wide (~0.2 at 400,
    docs/report.md): a trend, not a tight certificate. 0: no whole-game fields (None)."""
    game_budget = settings.train.game_budget
    probe = asyncio.run(probe_policy(player, settings.policy.temperature, calls_probability=game_budget > 0))
    g = evaluate_grid(player.solution, probe.p_hit)
    game: dict[str, Any] = {}
    if game_budget > 0:
        game = asyncio.run(exact_game(player, game_budget, temperature=probe.temperature, probe=probe))
    return {
        "grid_accuracy": g.accuracy,
        "grid_cell_accuracy": g.cell_accuracy,
        "grid_value": g.value,
        "grid_regret": g.regret,
        "grid_p_hit_hit_optimal": g.p_hit_hit_optimal,
        "grid_p_hit_stick_optimal": g.p_hit_stick_optimal,
        "grid_hit_gap": g.hit_gap,
        "grid_p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None,
        "grid_p_hit": g.p_hit,
        "grid_by_gap": [asdict(b) for b in g.by_gap],  # accuracy and regret by the cost of a wrong call
        # the whole game, every decision with its history (None where game_budget is 0)
        "game_value": game.get("value"),
        "game_value_low": game.get("value_low"),
        "game_value_high": game.get("value_high"),
        "after_hit_accuracy": game.get("after_hit_accuracy"),
        "after_hit_accuracy_low": game.get("after_hit_accuracy_low"),
        "after_hit_accuracy_high": game.get("after_hit_accuracy_high"),
    }
