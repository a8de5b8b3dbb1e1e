"""The exact value of a whole-game policy, one whose decisions may depend on the game's history.

grid.py evaluates the policy of the first-decision prompts as if it held at every decision.
But a later prompt carries the episode so far (the earlier hands and the model's answers),
which a model may read differently: decisions after a hit were measured 61.6% right against
93.9% for first decisions. Here the policy is asked at every history it can reach.

A history is the sequence of observations the player has seen: the dealt hand, then the
hand after each hit. Its reach is the probability of the deal and the draws times the
policy's P(hit) at every earlier step. At a history the policy gives P(hit), P(stick) and,
as the rest, P(invalid). Sticking is worth the solver's exact Q(stick) (the dealer's play is
its outcome distribution); an invalid answer forfeits with the invalid score; a hit either
busts (-1) or leads to a child history. A hit that is the episode's `max_turns`-th answer
without busting is truncated by the env, scored like invalid. The value is the sum over
the explored histories of reach times these outcomes: exact, no sampling.

Where the tree is too large, histories are scored in order of reach (a heap) up to a
budget. An unscored history's subtree is worth at least W(s) and at most B(s), the values of
the worst and the best play from its state s, any history-dependent play included (a DP with
stick, hit and forfeit as the choices): the interval [value_low, value_high] is certified,
and its width is the sum over unscored histories of reach * (B(s) - W(s)). With the default
invalid score (-1) W is -1 and B is V*(s); either way the width is at most the unexplored
mass times (best outcome - worst outcome).

What the numbers are of depends on the policy callable (probe.py): for a model, P(hit) and
P(stick) are the probabilities of the two canonical calls exactly, and everything else counts
as invalid (see `probe.exact_game`).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from blackjack_rl.game.solver import CARD_PROBS, HIT, STICK, Solution, StateKey, after_hit, stick_outcome
from blackjack_rl.game.table import Observation, Rules

History = tuple[Observation, ...]  # the dealt hand, then the hand after each hit
# A batch of histories in, their (P(hit), P(stick)) out; P(invalid) is the rest.
NodePolicy = Callable[[Sequence[History]], Awaitable[Sequence[tuple[float, float]]]]
Progress = Callable[[int, float], None]  # (histories scored, current width) after each batch

BEST_OUTCOME = 1.0  # a game's best reward, 1.5 for a natural where naturals pay (see `outcome_range`)


def is_natural(history: History) -> bool:
    """Whether the hand at this history is a two-card 21 (the observation hides it; a soft
    21 is a natural exactly when it was dealt)."""
    return len(history) == 1 and history[0].player_sum == 21 and history[0].usable_ace


def deals() -> dict[Observation, float]:
    """P(first observation): the two player cards and the dealer's upcard, infinite deck."""
    out: dict[Observation, float] = {}
    for c1, p1 in CARD_PROBS:
        for c2, p2 in CARD_PROBS:
            s, u = after_hit(c1 + 10 if c1 == 1 else c1, c1 == 1, c2)
            for d, pd in CARD_PROBS:
                key = Observation(s, d, u)
                out[key] = out.get(key, 0.0) + p1 * p2 * pd
    return out


def outcome_bounds(rules: Rules, invalid_score: float) -> dict[StateKey, tuple[float, float]]:
    """(W, B) per state: the expected score of the worst and of the best play from it, where a
    play may stick, hit or forfeit (invalid_score) at every decision, depending on anything.
    With an infinite deck the future cards do not depend on the history, so a DP over states
    is the optimum over all history-dependent policies; the env's turn limit only truncates
    (scored like a forfeit), which these plays can already do."""
    memo: dict[StateKey, tuple[float, float]] = {}

    def bound(s: int, d: int, u: bool, n: bool) -> tuple[float, float]:
        key = (s, d, u, n)
        if key not in memo:
            stick = stick_outcome(s, d, n, rules).value
            lo = hi = 0.0
            for card, p in CARD_PROBS:
                s2, u2 = after_hit(s, u, card)
                w, b = (-1.0, -1.0) if s2 > 21 else bound(s2, d, u2, False)
                lo, hi = lo + p * w, hi + p * b
            memo[key] = (min(stick, lo, invalid_score), max(stick, hi, invalid_score))
        return memo[key]

    for obs in deals():
        bound(obs.player_sum, obs.dealer_card, obs.usable_ace, is_natural((obs,)))
    return memo


def outcome_range(rules: Rules, invalid_score: float) -> tuple[float, float]:
    """The worst and best score any single game can have: the loose, state-free bound."""
    best = 1.5 if rules.natural and not rules.sab else BEST_OUTCOME
    return min(-1.0, invalid_score), max(best, invalid_score)


@dataclass(frozen=True)
class GameTree:
    """The exact whole-game numbers of a policy, as far as the budget explored its tree.

    Accuracies are over the scored decisions, weighted by their reach (expected visits per
    deal). `*_accuracy` is P(the optimal action) with an invalid answer counted wrong, as
    `evaluate` counts it; `*_accuracy_valid` is P(optimal | one of the two calls)."""

    value_low: float
    value_high: float
    explored_mass: float  # P(a deal's whole play lies in the scored tree) = 1 - unexplored_mass
    unexplored_mass: float  # reach of the histories left unscored
    nodes: int  # histories scored
    max_depth: int  # hits before the deepest scored decision
    p_invalid: float  # P(the episode forfeits or is truncated), over the scored tree
    first_accuracy: float | None
    first_accuracy_valid: float | None
    after_hit_accuracy: float | None  # decisions after a hit (depth >= 1)
    after_hit_accuracy_valid: float | None
    stick_after_hit_accuracy: float | None  # the same decisions, had the player always stuck
    after_hit_decisions: float  # expected decisions after a hit per deal, over the scored tree
    # the accuracy after a hit whatever the unscored histories hold: all wrong or all right, with
    # as many decisions below each as always hitting could reach (equal to the accuracy when complete)
    after_hit_accuracy_low: float | None
    after_hit_accuracy_high: float | None
    roots: dict[Observation, tuple[float, float]] = field(repr=False, compare=False)  # first decisions scored
    frontier: tuple[tuple[History, float], ...] = field(repr=False, compare=False)  # unscored, with reach

    @property
    def value(self) -> float:
        """The centre of the certified interval: exact when the tree was covered, else within width / 2."""
        return 0.5 * (self.value_low + self.value_high)

    @property
    def width(self) -> float:
        return self.value_high - self.value_low

    @property
    def complete(self) -> bool:
        return not self.frontier

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("roots", "frontier")}
        return {"value": self.value, **d, "width": self.width, "complete": self.complete}


@dataclass
class _Totals:
    """Running sums over the scored histories."""

    value: float = 0.0
    invalid: float = 0.0
    nodes: int = 0
    max_depth: int = 0
    # [reach, reach * P(optimal), reach * P(valid), reach * [stick optimal]] for depth 0 and depth >= 1
    first: list[float] = field(default_factory=lambda: [0.0] * 4)
    later: list[float] = field(default_factory=lambda: [0.0] * 4)
    roots: dict[Observation, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _Tree:
    """The search state: the solved rules, the bounds of unscored subtrees, the heap."""

    solution: Solution
    invalid_score: float
    max_turns: int
    bounds: dict[StateKey, tuple[float, float]]
    heap: list[tuple[float, int, History]] = field(default_factory=list)
    pushed: int = 0
    open_low: float = 0.0  # sum of reach * W over the heap (kept as it changes; summed afresh at the end)
    open_high: float = 0.0
    totals: _Totals = field(default_factory=_Totals)

    def bound(self, history: History) -> tuple[float, float]:
        s, d, u = history[-1]
        return self.bounds[(s, d, u, is_natural(history))]

    def push(self, history: History, reach: float) -> None:
        w, b = self.bound(history)
        self.open_low += reach * w
        self.open_high += reach * b
        heapq.heappush(self.heap, (-reach, self.pushed, history))
        self.pushed += 1

    def pop(self, n: int, target_width: float) -> list[tuple[History, float]]:
        """Up to n of the likeliest histories; fewer where the rest already fit the target width
        (the children of those popped may widen it again: the caller's loop then goes on)."""
        out = []
        while self.heap and len(out) < n and not (out and 0.0 < target_width and self.width() <= target_width):
            neg, _, history = heapq.heappop(self.heap)
            w, b = self.bound(history)
            self.open_low += neg * w
            self.open_high += neg * b
            out.append((history, -neg))
        return out

    def width(self) -> float:
        return self.open_high - self.open_low


def _checked(history: History, p: tuple[float, float]) -> tuple[float, float]:
    p_hit, p_stick = float(p[0]), float(p[1])
    if not (0.0 <= p_hit <= 1.0 and 0.0 <= p_stick <= 1.0 and p_hit + p_stick <= 1.0 + 1e-9):
        raise ValueError(f"the policy gave P(hit) {p_hit!r}, P(stick) {p_stick!r} at {history}: "
                         "each must be in [0, 1] and their sum at most 1")
    return p_hit, p_stick


def _score(tree: _Tree, history: History, reach: float, p_hit: float, p_stick: float) -> None:
    """Add one scored history: its stick, forfeit and bust outcomes, and its children to the heap."""
    t, sol = tree.totals, tree.solution
    obs, depth, natural = history[-1], len(history) - 1, is_natural(history)
    p_invalid = max(0.0, 1.0 - p_hit - p_stick)
    value = p_stick * sol.q_values(obs, natural)[0] + p_invalid * tree.invalid_score
    invalid = p_invalid
    if p_hit > 0.0:
        for card, p in CARD_PROBS:
            s2, u2 = after_hit(obs.player_sum, obs.usable_ace, card)
            if s2 > 21:
                value -= p_hit * p
            elif depth + 1 >= tree.max_turns:  # the env truncates after its last allowed answer
                value += p_hit * p * tree.invalid_score
                invalid += p_hit * p
            else:
                tree.push((*history, Observation(s2, obs.dealer_card, u2)), reach * p_hit * p)
    t.value += reach * value
    t.invalid += reach * invalid
    t.nodes += 1
    t.max_depth = max(t.max_depth, depth)
    stick_best = sol.best_action(obs, natural) == STICK
    sums = t.first if depth == 0 else t.later
    sums[0] += reach
    sums[1] += reach * (p_stick if stick_best else p_hit)
    sums[2] += reach * (p_hit + p_stick)
    sums[3] += reach * stick_best
    if depth == 0:
        t.roots[obs] = (p_hit, p_stick)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0.0 else None


@functools.lru_cache(maxsize=None)
def most_decisions(player_sum: int, usable_ace: bool, answers_left: int) -> float:
    """The most decisions any play can expect from a decision on, itself included: always hitting
    (a stick or an invalid answer ends the episode at one), until a bust or the last allowed answer."""
    if answers_left <= 1:
        return 1.0
    more = 0.0
    for card, p in CARD_PROBS:
        s2, u2 = after_hit(player_sum, usable_ace, card)
        if s2 <= 21:
            more += p * most_decisions(s2, u2, answers_left - 1)
    return 1.0 + more


def _after_hit_bounds(tree: _Tree, frontier: Sequence[tuple[History, float]]) -> tuple[float | None, float | None]:
    """An unscored history holds at most `most_decisions` decisions after a hit (less its own, if it
    is a dealt hand). Counting them all wrong, or all right, bounds the reach-weighted accuracy."""
    right, seen = tree.totals.later[1], tree.totals.later[0]
    unseen = math.fsum(r * (most_decisions(h[-1].player_sum, h[-1].usable_ace, tree.max_turns - (len(h) - 1))
                            - (len(h) == 1)) for h, r in frontier)
    return _ratio(right, seen + unseen), _ratio(right + unseen, seen + unseen)


def _result(tree: _Tree) -> GameTree:
    t = tree.totals
    frontier = tuple((h, -neg) for neg, _, h in sorted(tree.heap))
    low = math.fsum([t.value, *(r * tree.bound(h)[0] for h, r in frontier)])
    high = math.fsum([t.value, *(r * tree.bound(h)[1] for h, r in frontier)])
    unexplored = math.fsum(r for _, r in frontier)
    after_low, after_high = _after_hit_bounds(tree, frontier)
    return GameTree(
        value_low=low, value_high=high, explored_mass=1.0 - unexplored, unexplored_mass=unexplored,
        nodes=t.nodes, max_depth=t.max_depth, p_invalid=t.invalid,
        first_accuracy=_ratio(t.first[1], t.first[0]), first_accuracy_valid=_ratio(t.first[1], t.first[2]),
        after_hit_accuracy=_ratio(t.later[1], t.later[0]), after_hit_accuracy_valid=_ratio(t.later[1], t.later[2]),
        stick_after_hit_accuracy=_ratio(t.later[3], t.later[0]), after_hit_decisions=t.later[0],
        after_hit_accuracy_low=after_low, after_hit_accuracy_high=after_high,
        roots=dict(t.roots), frontier=frontier,
    )


async def evaluate_game(solution: Solution, policy: NodePolicy, *, invalid_score: float = -1.0,
                        max_turns: int = 10, budget: int = 100_000, target_width: float = 0.0,
                        min_nodes: int = 0, batch: int = 256, progress: Progress | None = None) -> GameTree:
    """Score the policy's histories in order of reach, `batch` at a time, until the tree is
    covered, `budget` histories are scored, or the certified width is at most `target_width`
    once `min_nodes` are (a model whose calls are rare meets any width with its first
    decisions alone, yet its decisions after a hit are worth reading)."""
    if budget < 1 or batch < 1:
        raise ValueError(f"budget and batch must be at least 1, got {budget} and {batch}")
    tree = _Tree(solution, invalid_score, max_turns, outcome_bounds(solution.rules, invalid_score))
    for obs, p in sorted(deals().items()):
        tree.push((obs,), p)
    return await _search(tree, policy, budget, target_width, min_nodes, batch, progress)


async def hit_value(solution: Solution, policy: NodePolicy, history: History, *, invalid_score: float = -1.0,
                    max_turns: int = 10, budget: int = 1_000, target_width: float = 0.0,
                    batch: int = 256) -> GameTree:
    """Q^pi(history, hit): the value of hitting at `history` and then playing the policy, exact
    or within the certified interval (its tree is the subtree below the hit, reach 1 at its root).
    With Q^pi(history, stick) = Q*(stick) (what follows a stick does not depend on the policy),
    this gives the policy's own advantages at any history (fidelity.py)."""
    if budget < 1 or batch < 1:
        raise ValueError(f"budget and batch must be at least 1, got {budget} and {batch}")
    tree = _Tree(solution, invalid_score, max_turns, outcome_bounds(solution.rules, invalid_score))
    obs, depth = history[-1], len(history) - 1
    for card, p in CARD_PROBS:
        s2, u2 = after_hit(obs.player_sum, obs.usable_ace, card)
        if s2 > 21:
            tree.totals.value -= p
        elif depth + 1 >= max_turns:
            tree.totals.value += p * invalid_score
            tree.totals.invalid += p
        else:
            tree.push((*history, Observation(s2, obs.dealer_card, u2)), p)
    return await _search(tree, policy, budget, target_width, 0, batch, None)


async def _search(tree: _Tree, policy: NodePolicy, budget: int, target_width: float, min_nodes: int, batch: int,
                  progress: Progress | None) -> GameTree:
    def target() -> float:
        return target_width if tree.totals.nodes >= min_nodes else 0.0

    while tree.heap and tree.totals.nodes < budget and not (target() > 0.0 and tree.width() <= target()):
        done = tree.totals.nodes
        nodes = tree.pop(min(batch, budget - done, min_nodes - done if done < min_nodes else batch), target())
        probs = await policy([h for h, _ in nodes])
        if len(probs) != len(nodes):
            raise ValueError(f"the policy answered {len(probs)} of {len(nodes)} histories")
        for (history, reach), p in zip(nodes, probs):
            _score(tree, history, reach, *_checked(history, p))
        if progress is not None:
            progress(tree.totals.nodes, max(0.0, tree.width()))
    return _result(tree)
