"""Exact optimal play for Blackjack-v1 by dynamic programming over an infinite deck.

Everything a model is scored against comes from here, so every value is an
expectation over unseen cards: nothing reads the seeded deck (the Atropos
"thinking" variant replayed the deck and so scored with knowledge of the future).

With an infinite deck the dealer's hole card and every later card are independent
of the player's cards, so the player's observation (sum, dealer card, usable ace)
is a sufficient state, plus one bit the observation hides: whether the hand is a
two-card natural, which matters only under the `natural` and `sab` rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from blackjack_rl.game.table import HIT, STICK, Observation, Rules
DEALER_CARDS = tuple(range(1, 11))
HARD_SUMS = tuple(range(4, 22))
SOFT_SUMS = tuple(range(12, 22))

GridKey = Observation  # a chart cell is the state the model is shown

# Row order of the chart: hard totals, then soft ones, each against dealer ace..10.
GRID_STATES: tuple[Observation, ...] = tuple(
    [Observation(s, d, False) for s in HARD_SUMS for d in DEALER_CARDS]
    + [Observation(s, d, True) for s in SOFT_SUMS for d in DEALER_CARDS]
)
CARD_PROBS: tuple[tuple[int, float], ...] = tuple((c, (4 if c == 10 else 1) / 13) for c in range(1, 11))

# Dealer final hands: index 0..4 = totals 17..21 without a natural, 5 = natural, 6 = bust.
_NATURAL, _BUST = 5, 6

StateKey = tuple[int, int, bool, bool]  # (player_sum, dealer_card, usable_ace, natural)


@lru_cache(maxsize=None)
def _dealer_from(raw: int, has_ace: bool, two_cards: bool) -> tuple[float, ...]:
    total = raw + 10 if has_ace and raw + 10 <= 21 else raw
    out = [0.0] * 7
    if total > 21:
        out[_BUST] = 1.0
    elif total >= 17:  # soft 17 stands, as in Gymnasium
        out[_NATURAL if two_cards and total == 21 else total - 17] = 1.0
    else:
        for card, p in CARD_PROBS:
            for i, q in enumerate(_dealer_from(raw + card, has_ace or card == 1, False)):
                out[i] += p * q
    return tuple(out)


@lru_cache(maxsize=None)
def dealer_final(upcard: int) -> tuple[float, ...]:
    """Distribution of the dealer's final hand given the upcard (hole card still unseen)."""
    out = [0.0] * 7
    for hole, p in CARD_PROBS:
        for i, q in enumerate(_dealer_from(upcard + hole, upcard == 1 or hole == 1, True)):
            out[i] += p * q
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Expected reward and win/draw/loss probabilities from some state on."""

    value: float
    win: float
    draw: float
    loss: float

    def mix(self, other: "Outcome", w_other: float) -> "Outcome":
        a = 1.0 - w_other
        return Outcome(
            a * self.value + w_other * other.value,
            a * self.win + w_other * other.win,
            a * self.draw + w_other * other.draw,
            a * self.loss + w_other * other.loss,
        )


_LOSS = Outcome(-1.0, 0.0, 0.0, 1.0)


def _stick_reward(player_sum: int, natural: bool, dealer_idx: int, rules: Rules) -> float:
    """Gymnasium's scoring of a stand, for one final dealer hand."""
    dealer_natural = dealer_idx == _NATURAL
    if dealer_idx == _BUST:
        base = 1.0
    else:
        dealer_total = 21 if dealer_natural else 17 + dealer_idx
        base = float((player_sum > dealer_total) - (player_sum < dealer_total))
    if rules.sab:
        return 1.0 if natural and not dealer_natural else base
    if rules.natural and natural and base == 1.0:
        return 1.5
    return base


@lru_cache(maxsize=None)  # a few hundred states per rule set, asked for by every exact computation
def stick_outcome(player_sum: int, dealer_card: int, natural: bool, rules: Rules) -> Outcome:
    value = win = draw = loss = 0.0
    for idx, p in enumerate(dealer_final(dealer_card)):
        if p == 0.0:
            continue
        r = _stick_reward(player_sum, natural, idx, rules)
        value += p * r
        win += p * (r > 0)
        draw += p * (r == 0)
        loss += p * (r < 0)
    return Outcome(value, win, draw, loss)


def after_hit(player_sum: int, usable_ace: bool, card: int) -> tuple[int, bool]:
    """The observation after drawing `card` (a sum over 21 is a bust)."""
    raw = (player_sum - 10 if usable_ace else player_sum) + card
    # Only a hand that already had a usable ace, or draws its first ace, can be soft;
    # a hard hand over 11 can never count an ace as 11 again.
    soft = (usable_ace or card == 1) and raw + 10 <= 21
    return (raw + 10 if soft else raw), soft


@dataclass(frozen=True)
class Solution:
    """V*, Q* and the optimal policy for one set of rules; shared, so never changed once solved."""

    rules: Rules
    q: dict[StateKey, tuple[float, float]] = field(repr=False)  # (Q[stick], Q[hit])
    start: Outcome  # expected return and outcome odds of optimal play from the deal

    @property
    def value(self) -> float:
        return self.start.value

    def q_values(self, obs: Observation | tuple, natural: bool = False) -> tuple[float, float]:
        s, d, u = obs
        return self.q[(int(s), int(d), bool(u), bool(natural) and int(s) == 21)]

    def best_action(self, obs: Observation | tuple, natural: bool = False) -> int:
        q_stick, q_hit = self.q_values(obs, natural)
        return HIT if q_hit > q_stick else STICK  # ties stand: no reason to draw

    def v(self, obs: Observation | tuple, natural: bool = False) -> float:
        return max(self.q_values(obs, natural))

    def regret(self, obs: Observation | tuple, action: int, natural: bool = False) -> float:
        """Expected return given up by `action` against the best action, >= 0."""
        qs = self.q_values(obs, natural)
        return max(qs) - qs[action]

    def chart(self, soft: bool) -> dict[int, dict[int, int]]:
        """player_sum -> dealer_card -> optimal action, for hard or soft hands."""
        sums = SOFT_SUMS if soft else HARD_SUMS
        return {s: {d: self.best_action((s, d, soft)) for d in DEALER_CARDS} for s in sums}


def _all_states() -> list[StateKey]:
    keys = [(s, d, False, False) for s in HARD_SUMS for d in DEALER_CARDS]
    keys += [(s, d, True, False) for s in SOFT_SUMS for d in DEALER_CARDS]
    keys += [(21, d, True, True) for d in DEALER_CARDS]
    return keys


def solve(rules: Rules | None = None) -> Solution:
    return _solve(rules or Rules())


@lru_cache(maxsize=None)  # one command asks for it more than once (the players, the report's baselines)
def _solve(rules: Rules) -> Solution:
    q: dict[StateKey, tuple[float, float]] = {}

    def value(s: int, d: int, u: bool, n: bool) -> float:
        key = (s, d, u, n)
        if key not in q:
            q_stick = stick_outcome(s, d, n, rules).value
            q_hit = 0.0
            for card, p in CARD_PROBS:
                s2, u2 = after_hit(s, u, card)
                q_hit += p * (-1.0 if s2 > 21 else value(s2, d, u2, False))
            q[key] = (q_stick, q_hit)
        return max(q[key])

    for key in _all_states():
        value(*key)
    unscored = Solution(rules, q, Outcome(0.0, 0.0, 0.0, 0.0))
    return replace(unscored, start=policy_outcome(rules, lambda s, d, u, n: float(unscored.best_action((s, d, u), n))))


def policy_outcome(rules: Rules, hit_probability) -> Outcome:
    """Exact expected return and outcome odds of a stationary policy from the deal.

    `hit_probability(player_sum, dealer_card, usable_ace, natural) -> float in [0, 1]`.
    Used for the optimal policy and for baselines (always stick, uniform random).
    """
    memo: dict[StateKey, Outcome] = {}

    def outcome(s: int, d: int, u: bool, n: bool) -> Outcome:
        key = (s, d, u, n)
        if key in memo:
            return memo[key]
        h = float(hit_probability(s, d, u, n))
        result = stick_outcome(s, d, n, rules)
        if h > 0.0:
            hit = Outcome(0.0, 0.0, 0.0, 0.0)
            for card, p in CARD_PROBS:
                s2, u2 = after_hit(s, u, card)
                nxt = _LOSS if s2 > 21 else outcome(s2, d, u2, False)
                hit = Outcome(hit.value + p * nxt.value, hit.win + p * nxt.win,
                              hit.draw + p * nxt.draw, hit.loss + p * nxt.loss)
            result = result.mix(hit, h)
        memo[key] = result
        return result

    total = Outcome(0.0, 0.0, 0.0, 0.0)
    for c1, p1 in CARD_PROBS:
        for c2, p2 in CARD_PROBS:
            s, u = after_hit(c1 + 10 if c1 == 1 else c1, c1 == 1, c2)
            natural = s == 21
            for d, pd in CARD_PROBS:
                o = outcome(s, d, u, natural)
                w = p1 * p2 * pd
                total = Outcome(total.value + w * o.value, total.win + w * o.win,
                                total.draw + w * o.draw, total.loss + w * o.loss)
    return total


def baselines(rules: Rules | None = None) -> dict[str, Outcome]:
    """Reference policies every report compares a model against."""
    rules = rules or Rules()
    return {
        "optimal": solve(rules).start,
        "always_stick": policy_outcome(rules, lambda s, d, u, n: 0.0),
        "random": policy_outcome(rules, lambda s, d, u, n: 0.5),
    }
