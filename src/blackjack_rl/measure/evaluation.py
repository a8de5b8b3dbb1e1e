"""Evaluation on a fixed seed set: the same deals for every model, scored against Q*.

Outcomes are noisy (per-episode sd ~0.95: 100 episodes cannot tell optimal play
from always-stick), so besides win/draw/loss with confidence intervals we score
every decision against the exact optimal action (accuracy, regret), which is
measurable on a few hundred episodes.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

from blackjack_rl.rollout.episodes import Episode
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import EVAL_SEED_BASE
from blackjack_rl.contract.records import MeanCI, Metrics, RateCI, ReasonCount, Reference, SeedRange, Status, SCORED_AS_INVALID
from blackjack_rl.game.solver import baselines

Z95 = 1.959963984540054


# Below this many values the normal interval of a mean is not to be trusted (the mean of a
# few -1/+1 rewards is far from normal): no interval is given, and the pages say "too few".
MIN_N_FOR_INTERVAL = 30


def interval(mean: float, se: float, n: int, bounds: tuple[float, float] | None) -> tuple[float | None, float | None]:
    """The normal 95% interval, cut to the range the true value can take; (None, None) for too few values."""
    if n < MIN_N_FOR_INTERVAL:
        return None, None
    low, high = mean - Z95 * se, mean + Z95 * se
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return low, high


def mean_ci(values: list[float], bounds: tuple[float, float] | None = None) -> MeanCI:
    """Mean, standard error and a 95% interval within `bounds` (the range of the true mean);
    `too_few` (and no interval) below MIN_N_FOR_INTERVAL values."""
    n = len(values)
    if n == 0:
        return MeanCI(mean=None, ci95_low=None, ci95_high=None, stderr=None, n=0, too_few=True)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n)
    low, high = interval(mean, se, n, bounds)
    return MeanCI(mean=mean, ci95_low=low, ci95_high=high, stderr=se, n=n, too_few=low is None)


def max_payout(rules: Any) -> float:
    """The most one hand can win: 1.5 for a natural where it pays 3:2 (not under Sutton & Barto rules)."""
    return 1.5 if rules.natural and not rules.sab else 1.0


def reward_bounds(rules: Any, invalid_score: float) -> tuple[float, float]:
    """Where a mean reward (or expected score) can lie: a lost hand, a won natural, the invalid score."""
    return min(-1.0, invalid_score), max(max_payout(rules), invalid_score)


def rate_ci(k: int, n: int) -> RateCI:
    """Wilson interval: sane at 0% and 100%, where the normal approximation collapses."""
    if n == 0:
        return RateCI(rate=None, ci95_low=None, ci95_high=None)
    p = k / n
    denom = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    # exact at the edges, where rounding would leave a 1e-17 residue
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return RateCI(rate=p, ci95_low=low, ci95_high=high)


def _expected_game_score(ep: Episode, invalid_score: float) -> float:
    """V*(s0) minus regret for finished games (no format bonus), the invalid score otherwise."""
    if ep.status != Status.FINISHED:
        return invalid_score
    return ep.start_value - sum(d.regret for d in ep.decisions if d.regret is not None)


def compute_metrics(episodes: Iterable[Episode], player: Player) -> Metrics:
    episodes = list(episodes)
    played = [ep for ep in episodes if not ep.failed]
    n = len(played)
    outcomes = Counter(ep.outcome for ep in played if ep.status == Status.FINISHED)
    invalid = Counter(ep.invalid_reason for ep in played if ep.status in SCORED_AS_INVALID)
    decisions = [d for ep in played for d in ep.decisions]
    valid = [d for d in decisions if d.action is not None]
    rules = player.solution.rules
    refs = baselines(rules)
    settings = player.settings
    bounds = reward_bounds(rules, settings.invalid_score)
    regret_bound = (0.0, max((abs(qh - qs) for qs, qh in player.solution.q.values()), default=0.0))
    return Metrics(
        policy=player.policy.generation_params(),
        rules=rules,
        seeds=SeedRange(first=EVAL_SEED_BASE, count=len(episodes)),
        episodes=len(episodes),
        episodes_played=n,
        episodes_failed=len(episodes) - n,
        failure_examples=[ep.error for ep in episodes if ep.failed][:5],
        win=rate_ci(outcomes["win"], n),
        draw=rate_ci(outcomes["draw"], n),
        loss=rate_ci(outcomes["loss"], n),
        invalid=rate_ci(sum(invalid.values()), n),
        invalid_by_reason={reason: ReasonCount(count=k, rate=k / n) for reason, k in sorted(invalid.items())},
        # The game reward (invalid answers at the invalid score), whatever the training scoring mode.
        mean_reward=mean_ci([ep.reward if ep.status == Status.FINISHED else settings.invalid_score
                             for ep in played], bounds),
        # The same quantity estimated from Q*: unbiased, with far less noise from the cards.
        mean_expected_score=mean_ci([_expected_game_score(ep, settings.invalid_score) for ep in played], bounds),
        mean_game_reward=mean_ci([ep.reward for ep in played if ep.status == Status.FINISHED],
                                 (-1.0, max_payout(rules))),
        decisions=len(decisions),
        valid_decisions=len(valid),
        decision_accuracy=rate_ci(sum(d.action == d.optimal for d in decisions), len(decisions)),
        decision_accuracy_valid=rate_ci(sum(d.action == d.optimal for d in valid), len(valid)),
        mean_regret=mean_ci([d.regret for d in valid], regret_bound),
        reference={
            name: Reference(value=o.value, win=o.win, draw=o.draw, loss=o.loss) for name, o in refs.items()
        },
        optimal_value=refs["optimal"].value,
        invalid_score=settings.invalid_score,
        # What training scores were (each episode's `score`); the game reward and expected score
        # above never include the format bonus, whatever the scoring mode.
        scoring=settings.scoring,
        format_bonus=settings.format_bonus,
    )
