"""Exact, noise-free evaluation of a policy on the strategy chart.

A sampled evaluation of 200 deals cannot tell optimal play (-0.047) from always sticking
(-0.186): one episode's reward has a standard deviation of ~0.95. But a model's policy at a
first decision is fully described by one number per state, its probability of hitting among
its valid answers, which its logprobs of the two valid calls give without sampling. With
those 280 numbers (hard 4-21, soft 12-21, dealer ace-10) the solver's dynamic programming
gives the exact expected return of that stochastic policy over the real deal distribution,
how often the policy itself visits each state, and so its exact decision accuracy and regret.

What this covers, and what it does not:
- It evaluates the *stationary* policy the first-decision prompts define. A later decision
  comes with the history of the episode in the prompt, which a model may read differently;
  `evaluate` measures those decisions by sampling (decision accuracy, regret), and the gap
  between the two numbers says how much history matters.
- It is conditioned on a valid call: invalid answers are measured by sampling
  (`evaluate`'s valid-call rate), never folded into these numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

from blackjack_rl.game.table import Rules
from blackjack_rl.game.solver import (CARD_PROBS, DEALER_CARDS, GRID_STATES, HARD_SUMS, HIT, SOFT_SUMS, GridKey, Solution,
                                      after_hit, policy_outcome)



# Bands of the cost of a wrong call, |Q*(hit) - Q*(stick)|: where a policy's errors lie and what they cost.
GAP_EDGES = (0.0, 0.01, 0.03, 0.1, 0.3)


@dataclass(frozen=True)
class GapBand:
    """The states whose two calls differ in value by `low` to `high` (None: no upper end).

    Regret splits over states exactly (the performance-difference lemma): V* - V = the sum over
    the states the policy visits of visits * P(wrong call) * gap, so the bands' regrets add up to
    the chart's. Accuracy alone cannot say whether the errors lie where they cost nothing."""

    low: float
    high: float | None
    visits: float  # expected decisions per deal in these states, under the policy
    accuracy: float | None  # P(the optimal action) over those decisions (None: never visited)
    regret: float  # their share of the chart's regret


@dataclass(frozen=True)
class GridEvaluation:
    """The exact numbers of one stochastic first-decision policy (all expectations, no noise)."""

    value: float  # expected return from the deal
    win: float
    draw: float
    loss: float
    optimal_value: float
    regret: float  # optimal_value - value, >= 0
    accuracy: float  # P(the optimal action) averaged over the states the policy visits, by visits
    cell_accuracy: float  # the same, every one of the 280 cells weighted equally
    p_hit_hit_optimal: float  # mean P(hit) over cells where hitting is optimal
    p_hit_stick_optimal: float  # mean P(hit) over cells where sticking is optimal
    p_hit: list[list[float]]  # [row][dealer card], rows in GRID_STATES order (hard 4..21, soft 12..21)
    by_gap: tuple[GapBand, ...]  # accuracy and regret by the cost of a wrong call (GAP_EDGES)

    @property
    def hit_gap(self) -> float:
        """How differently the policy treats hit-optimal and stick-optimal cells: 0 for a
        constant policy, 1 for optimal play. A shrinking gap is what collapse looks like."""
        return self.p_hit_hit_optimal - self.p_hit_stick_optimal

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_gap": self.hit_gap}


def _check(p_hit: Mapping[GridKey, float]) -> None:
    missing = [k for k in GRID_STATES if k not in p_hit]
    if missing:
        raise ValueError(f"the grid lacks {len(missing)} states, e.g. {missing[0]}")
    bad = [k for k in GRID_STATES if not (0.0 <= p_hit[k] <= 1.0) or math.isnan(p_hit[k])]
    if bad:
        raise ValueError(f"P(hit) must be in [0, 1]; {bad[0]} has {p_hit[bad[0]]!r}")


def visits(rules: Rules, hit_probability: Callable[[int, int, bool, bool], float]) -> dict[tuple, float]:
    """Expected number of times the policy decides in each state (sum, dealer, soft, natural),
    per deal. Hitting strictly raises the hand's raw total (aces counted as 1), so one pass in
    that order propagates every state's mass before the state is read."""
    mass: dict[tuple, float] = {}
    for c1, p1 in CARD_PROBS:
        for c2, p2 in CARD_PROBS:
            s, u = after_hit(c1 + 10 if c1 == 1 else c1, c1 == 1, c2)
            for d, pd in CARD_PROBS:
                key = (s, d, u, s == 21)
                mass[key] = mass.get(key, 0.0) + p1 * p2 * pd

    def raw(key: tuple) -> int:
        return key[0] - 10 if key[2] else key[0]

    done: dict[tuple, float] = {}
    while mass:
        key = min(mass, key=raw)
        m = mass.pop(key)
        done[key] = m
        s, d, u, n = key
        h = float(hit_probability(s, d, u, n))
        if h <= 0.0:
            continue
        for card, p in CARD_PROBS:
            s2, u2 = after_hit(s, u, card)
            if s2 <= 21:
                nxt = (s2, d, u2, False)
                mass[nxt] = mass.get(nxt, 0.0) + m * h * p
    return done


def evaluate_grid(solution: Solution, p_hit: Mapping[GridKey, float]) -> GridEvaluation:
    """Exact value, accuracy and regret of the policy that hits with `p_hit[state]`."""
    _check(p_hit)

    def hit_probability(s: int, d: int, u: bool, n: bool) -> float:
        return p_hit[(s, d, u)]

    rules = solution.rules
    outcome = policy_outcome(rules, hit_probability)
    seen = visits(rules, hit_probability)

    def p_optimal(s: int, d: int, u: bool, n: bool) -> float:
        h = p_hit[(s, d, u)]
        return h if solution.best_action((s, d, u), n) == HIT else 1.0 - h

    total = sum(seen.values())
    accuracy = sum(m * p_optimal(*k) for k, m in seen.items()) / total
    by_gap = _by_gap(solution, seen, p_optimal)
    cells = [p_optimal(s, d, u, False) for s, d, u in GRID_STATES]
    hit_cells = [p_hit[k] for k in GRID_STATES if solution.best_action(k) == HIT]
    stick_cells = [p_hit[k] for k in GRID_STATES if solution.best_action(k) != HIT]
    rows = len(HARD_SUMS) + len(SOFT_SUMS)
    table = [[p_hit[GRID_STATES[r * len(DEALER_CARDS) + c]] for c in range(len(DEALER_CARDS))] for r in range(rows)]
    return GridEvaluation(
        value=outcome.value,
        win=outcome.win,
        draw=outcome.draw,
        loss=outcome.loss,
        optimal_value=solution.value,
        regret=solution.value - outcome.value,
        accuracy=accuracy,
        cell_accuracy=sum(cells) / len(cells),
        p_hit_hit_optimal=sum(hit_cells) / len(hit_cells),
        p_hit_stick_optimal=sum(stick_cells) / len(stick_cells),
        p_hit=table,
        by_gap=by_gap,
    )


def _by_gap(solution: Solution, seen: Mapping[tuple, float],
            p_optimal: Callable[[int, int, bool, bool], float]) -> tuple[GapBand, ...]:
    sums = {low: [0.0, 0.0, 0.0] for low in GAP_EDGES}  # visits, visits * P(optimal), regret
    for (s, d, u, n), m in seen.items():
        q_stick, q_hit = solution.q_values((s, d, u), n)
        gap = abs(q_hit - q_stick)
        low = max(e for e in GAP_EDGES if gap >= e)
        p = p_optimal(s, d, u, n)
        band = sums[low]
        band[0] += m
        band[1] += m * p
        band[2] += m * (1.0 - p) * gap
    highs = (*GAP_EDGES[1:], None)
    return tuple(GapBand(low, high, v, a / v if v > 0 else None, r)
                 for (low, (v, a, r)), high in zip(sums.items(), highs))
