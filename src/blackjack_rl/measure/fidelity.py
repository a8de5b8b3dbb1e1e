"""Advantage fidelity: how close a credit scheme's credit is to the policy's exact advantage.

Blackjack is the one environment where the truth is known: for the policy that produced a
group, A^pi(h, a) = Q^pi(h, a) - V^pi(h) at the history h, history included (tree.py's
`hit_value` with the model's own probabilities; Q^pi(h, stick) = Q*(stick)). A scheme's credit
for the action it took is then scored against A^pi:

- sign agreement, weighted by |A^pi| and leaving out near-ties (|A^pi| < NEAR_TIE): a wrong sign
  on a decision that barely matters costs little; a credit of exactly 0 counts half (a coin);
- correlation, bias (mean of credit - A^pi, in reward units only where the credit is);
- noise from two independent draws of the credit at the same decision: noise^2 = E[(c1 - c2)^2] / 2.

What counts as a group's credit for an action (`credit_samples`):
- with per-token `advantages`: the advantage on the answer's action word minus that on its first
  token (the format credit our token modes put on every token), and for a forced call of a
  counterfactual group divided by the policy's probability of that call (its credit is the
  all-action term p(a) * (Q(a) - V), unless the group records `forced_weight` none or greedy,
  whose credit is the call's own: Q(a) - V, or the scaled gap for the better call and 0 for the
  other);
- without: GRPO's scalar advantage of the sequence (score - mean, over the std), which the
  trainer puts on every token, so every decision of a whole episode gets its episode's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from blackjack_rl.contract.protocol import HIT, STICK
from blackjack_rl.contract.records import EpisodeRecord, ScoredDataGroup, StepRecord
from blackjack_rl.contract.tokens import trained_spans
from blackjack_rl.game.solver import Solution
from blackjack_rl.game.table import Observation, Table
from blackjack_rl.measure.tree import History, NodePolicy, hit_value, is_natural
from blackjack_rl.rollout.credit import action_char_span, action_token_indices, group_advantages

NEAR_TIE = 0.01  # |A^pi| below this: a decision whose sign does not matter


@dataclass(frozen=True, slots=True)
class CreditSample:
    """The credit a scheme gave one action taken at one history."""

    history: History
    action: int  # HIT or STICK
    credit: float
    draw: int = 0  # which independent draw of the credit (noise needs two at the same decision)


@dataclass(frozen=True, slots=True)
class Truth:
    """The policy's exact values at a history."""

    p_hit: float
    p_stick: float
    q_stick: float
    q_hit: float
    q_hit_width: float  # Q^pi(h, hit) is certified within this (0: its subtree was covered)
    invalid_score: float

    @property
    def v(self) -> float:
        p_invalid = max(0.0, 1.0 - self.p_hit - self.p_stick)
        return self.p_hit * self.q_hit + self.p_stick * self.q_stick + p_invalid * self.invalid_score

    def advantage(self, action: int) -> float:
        return (self.q_hit if action == HIT else self.q_stick) - self.v


@dataclass(frozen=True)
class FidelityScores:
    """How one scheme's credit compares with A^pi over a probe set."""

    decisions: int  # credits scored
    sign_weighted: float | None  # sign agreement weighted by |A^pi|
    sign_clear: float | None  # sign agreement over |A^pi| >= NEAR_TIE
    clear_decisions: int
    correlation: float | None
    bias: float | None
    noise: float | None  # from the decisions with two draws
    noise_pairs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _agree(credit: float, truth: float) -> float:
    if credit == 0.0 or truth == 0.0:
        return 0.5
    return 1.0 if (credit > 0.0) == (truth > 0.0) else 0.0


def fidelity_scores(credits: Sequence[float], truths: Sequence[float],
                    pairs: Sequence[tuple[float, float]] = ()) -> FidelityScores:
    """The scores of credits against the truth (same order); `pairs` are two independent draws
    of the credit at the same decisions (for the noise)."""
    if len(credits) != len(truths):
        raise ValueError(f"{len(credits)} credits for {len(truths)} truths")
    n = len(credits)
    weight = math.fsum(abs(t) for t in truths)
    clear = [(c, t) for c, t in zip(credits, truths) if abs(t) >= NEAR_TIE]
    return FidelityScores(
        decisions=n,
        sign_weighted=math.fsum(abs(t) * _agree(c, t) for c, t in zip(credits, truths)) / weight if weight else None,
        sign_clear=math.fsum(_agree(c, t) for c, t in clear) / len(clear) if clear else None,
        clear_decisions=len(clear),
        correlation=_correlation(credits, truths),
        bias=math.fsum(c - t for c, t in zip(credits, truths)) / n if n else None,
        noise=math.sqrt(math.fsum((a - b) ** 2 for a, b in pairs) / (2 * len(pairs))) if pairs else None,
        noise_pairs=len(pairs),
    )


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    n = len(xs)
    if n < 2:
        return None
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx == 0.0 or syy == 0.0:
        return None
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


def score_samples(samples: Sequence[CreditSample], truths: dict[History, Truth]) -> FidelityScores:
    """Every sample against A^pi of its action; the draws at one (history, action) pair up for
    the noise (consecutive draws, each used once)."""
    by_decision: dict[tuple[History, int], list[float]] = {}
    for s in samples:
        by_decision.setdefault((s.history, s.action), []).append(s.credit)
    pairs = [(cs[i], cs[i + 1]) for cs in by_decision.values() for i in range(0, len(cs) - 1, 2)]
    return fidelity_scores([s.credit for s in samples], [truths[s.history].advantage(s.action) for s in samples],
                           pairs)


async def exact_truths(solution: Solution, policy: NodePolicy, histories: Sequence[History], *,
                       invalid_score: float, max_turns: int, budget: int = 1_000,
                       target_width: float = 0.002) -> dict[History, Truth]:
    """A^pi's ingredients at each history: the policy's probabilities there and Q^pi of both
    actions (the hit's within a certified width of at most `target_width` where `budget`
    histories below it suffice)."""
    unique = list(dict.fromkeys(histories))
    probs = await policy(unique) if unique else []
    out = {}
    for h, (p_hit, p_stick) in zip(unique, probs):
        q_stick, _ = solution.q_values(h[-1], is_natural(h))
        tree = await hit_value(solution, policy, h, invalid_score=invalid_score, max_turns=max_turns,
                               budget=budget, target_width=target_width)
        out[h] = Truth(float(p_hit), float(p_stick), q_stick, tree.value, tree.width, invalid_score)
    return out


# --------------------------------------------------------------------------- reading groups


def _observation(state: Sequence[int]) -> Observation:
    return Observation(int(state[0]), int(state[1]), bool(state[2]))


def episode_histories(table: Table, seed: int, actions: Sequence[str | None]) -> list[History]:
    """The history at each decision of a whole episode dealt from `seed`, replayed on the table
    (each hit draws the seed's next card); decisions after an invalid answer are not replayed."""
    obs = table.reset(seed)
    history: History = (obs,)
    out = [history]
    for action in actions[:-1]:
        if action != "hit":
            break
        step = table.step(HIT)
        if step.terminated:
            break
        history = (*history, step.observation)
        out.append(history)
    return out


def credit_samples(group: ScoredDataGroup, table: Table, decode: Callable[[Sequence[int]], str],
                   scale: bool = True, draw: int = 0) -> list[CreditSample]:
    """The credit each action taken in a group got (see the module docstring); `scale` as the
    trainer's GRPO scaling of scalar advantages."""
    records = list(group.episodes)
    if not records:
        raise ValueError("the group carries none of our records (deal seeds and decision states): "
                         "its decisions cannot be placed")
    scalar = None if group.advantages else group_advantages(group.scores, scale)
    if isinstance(records[0], StepRecord):
        return _step_samples(group, records, scalar, decode, draw)
    return _episode_samples(group, records, scalar, table, decode, draw)


def _step_samples(group: ScoredDataGroup, records: Sequence[StepRecord], scalar: list[float] | None,
                  decode: Callable[[Sequence[int]], str], draw: int) -> list[CreditSample]:
    first = records[0]
    history = tuple(_observation(s) for s in (first.history or [])) + (_observation(first.state),)
    if first.decision and len(history) != first.decision + 1:
        raise ValueError(f"a step group of decision {first.decision} (seed {first.seed}) does not carry its "
                         "history: written before step records had one")
    out = []
    for i, r in enumerate(records):
        if r.action is None:
            continue
        action = HIT if r.action == "hit" else STICK
        if scalar is not None:
            credit = scalar[i]
        else:
            credit = _action_word_credit(group, i, 0, decode)
            if r.forced and group.generation_params.get("forced_weight", "policy") == "policy":
                p = (first.p_call or {}).get(r.action)
                if not p:
                    continue  # a call the policy never writes carries (and teaches) nothing
                credit /= p
        out.append(CreditSample(history, action, credit, draw))
    return out


def _episode_samples(group: ScoredDataGroup, records: Sequence[EpisodeRecord], scalar: list[float] | None,
                     table: Table, decode: Callable[[Sequence[int]], str], draw: int) -> list[CreditSample]:
    out = []
    for i, r in enumerate(records):
        if r.retries or r.score is None:
            continue  # a re-prompted episode's history is not the canonical one
        for j, history in enumerate(episode_histories(table, r.seed, r.actions)):
            action = r.actions[j]
            if action is None:
                break
            credit = scalar[i] if scalar is not None else _action_word_credit(group, i, j, decode)
            out.append(CreditSample(history, HIT if action == "hit" else STICK, credit, draw))
    return out


def _action_word_credit(group: ScoredDataGroup, seq: int, answer: int, decode: Callable[[Sequence[int]], str]) -> float:
    """The advantage on answer `answer` of sequence `seq`'s action word, less its first token's."""
    spans = trained_spans(group.masks[seq])
    texts = [m["content"] for m in group.messages[seq] if m.get("role") == "assistant"] if group.messages else []
    if answer >= len(spans) or answer >= len(texts):
        raise ValueError("a group with per-token advantages needs its messages to find each answer's action word")
    start, end = spans[answer]
    ids = group.tokens[seq][start:end]
    word = action_token_indices(ids, action_char_span(texts[-len(spans) + answer]), decode)
    if not word:
        return 0.0
    row = group.advantages[seq]
    return math.fsum(row[start + k] for k in word) / len(word) - row[start]
