"""Per-step numbers read from the groups themselves, so they mean the same in both sources.

Every group carries `episodes`, one record per sequence: for whole-episode groups the
actions taken and the optimal ones and the outcome; for step groups the one action and the
optimal one. That is all a trainer pulling from the API sees too, so local and API training
report the same way. An invalid answer counts as a wrong decision, as in `evaluate`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..evaluate import rate_ci


def _decisions(record: Mapping[str, Any]) -> list[tuple[str | None, str | None]]:
    if "actions" in record:  # a whole episode
        return list(zip(record.get("actions") or [], record.get("optimal_actions") or []))
    if "optimal" in record:  # one decision of a step group
        return [(record.get("action"), record.get("optimal"))]
    return []


def _records(group: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(group.get("episodes") or [{} for _ in group["scores"]])


def batch_metrics(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    # forced (counterfactual) answers were not sampled: they say nothing about the policy
    scores = [float(s) for g in groups for s, r in zip(g["scores"], _records(g)) if not r.get("forced")]
    records = [r for g in groups for r in _records(g) if not r.get("forced")]
    decisions = [d for r in records for d in _decisions(r)]
    valid = sum(a is not None for a, _ in decisions)
    correct = sum(a is not None and a == o for a, o in decisions)
    finished = [r for r in records if "outcome" in r and r.get("status") != "failed"]
    # counterfactual groups carry the policy's P(hit) among the two calls at their decision:
    # on the states the policy visits, an exact reading of its strategy with no extra cost
    p_hit: dict[str, list[float]] = {"hit": [], "stick": []}
    p_valid = []
    for g in groups:
        first = _records(g)[0]
        if first.get("p_call") and first.get("optimal") in p_hit:
            p_hit[first["optimal"]].append(float(first["p_call"]["hit"]))
        if first.get("p_valid") is not None:
            p_valid.append(float(first["p_valid"]))
    wins = sum(r.get("outcome") == "win" for r in finished)
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


def eval_summary(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The headline numbers of an `evaluate` metrics dict, with their 95% intervals."""
    n = metrics["episodes_played"]
    invalid_k = sum(v["count"] for v in metrics["invalid_by_reason"].values())
    return {
        "episodes": n,
        "valid_episodes": rate_ci(n - invalid_k, n),  # every answer a valid call, the game played out
        "valid_decisions": rate_ci(metrics["valid_decisions"], metrics["decisions"]),
        "win": metrics["win"],
        "draw": metrics["draw"],
        "loss": metrics["loss"],
        "decision_accuracy": metrics["decision_accuracy"],
        "mean_reward": metrics["mean_reward"],
        "mean_regret": metrics["mean_regret"],
        "reference": metrics.get("reference"),  # optimal, always stick, random: exact values and win rates
    }
