"""Per-token credit: the format of an answer and its decision are rewarded separately.

One scalar per answer puts the same advantage on every token of it, so "write a valid call"
and "say stick" would be rewarded together. Here each answer gets an advantage per token
(Atropos' optional `advantages` field, the shape of `tokens`):

- the *format* tokens (everything but the action word) carry the answer's validity credit:
  its validity score minus the mean over the sampled answers of its group;
- the *action* tokens (the word `hit` or `stick` of a valid call) carry the same validity
  credit plus the decision's credit: Q*(s, a) minus the mean of Q* over both actions, an
  expectation over unseen cards whose baseline does not depend on what the sampler drew.
  The action word is part of the format too (a call is valid only with one of the two
  words), and both words get the same validity credit, so it favours neither;
- every token of an invalid answer carries its validity credit: it made no decision.

In counterfactual groups both valid calls are added, forced, and their action tokens carry
the exact all-action policy gradient p(a) * (Q*(s, a) - V_p), with p the policy's own
probability of each call among the two and V_p = sum_a p(a) Q*(s, a); the sampled answers'
action tokens then carry nothing.

`scale_decisions` divides each decision's credit by its spread |Q*(hit) - Q*(stick)|
(floored at DECISION_SCALE_FLOOR), as GRPO divides a group by its std, so every state weighs
the same. docs/training/README.md has the runs that chose each of these.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from blackjack_rl.contract.protocol import HIT, STICK
from blackjack_rl.contract.tokens import MASKED, Trajectory, trained_spans


# Decisions whose two actions differ by less than this keep their (small) value scale when
# scaled: they barely matter to the game, so they must not weigh as much as one that does.
DECISION_SCALE_FLOOR = 0.05
# An estimated gap (reward only) within this many standard errors of zero is noise as much as
# signal: scaled, it is floored there, so its sign, a coin toss, does not get full weight.
ESTIMATE_FLOOR_SE = 2.0

# The action value inside a call, e.g. `"action": "hit"`; the last match is the call's.
_ACTION_VALUE = re.compile(r"""["']action["']\s*:\s*["']\s*(hit|stick)\s*["']""", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class AnswerCredit:
    """What credit one answer of a group earned, before it is spread over its tokens."""

    valid: bool
    action: int | None  # the decision of a valid answer
    forced: bool = False  # a counterfactual call the policy did not sample


@dataclass(frozen=True, slots=True)
class AnswerAdvantage:
    """One answer of a sequence, with the credit of its decision (0 for an invalid answer)."""

    text: str  # where the action word stands
    valid: bool
    decision: float


def action_char_span(text: str) -> tuple[int, int] | None:
    """Where the action word of a call stands in the answer text (last call wins)."""
    found = None
    for m in _ACTION_VALUE.finditer(text[:20_000]):
        found = m.span(1)
    return found


def action_token_indices(ids: Sequence[int], text_span: tuple[int, int] | None,
                         decode: Callable[[Sequence[int]], str]) -> list[int]:
    """Indices (into `ids`) of the tokens that spell the action word.

    Tokens are found by decoding growing prefixes, so any tokenizer works and a word split
    over several tokens ("st" + "ick") is credited on all of them.
    """
    if text_span is None:
        return []
    start, end = text_span
    out, previous = [], 0
    for i in range(len(ids)):
        length = len(decode(ids[: i + 1]))
        if length > start and previous < end:
            out.append(i)
        if length >= end:
            break
        previous = length
    return out


def validity_advantages(answers: Sequence[AnswerCredit], invalid_score: float, format_bonus: float,
                        weight: float = 1.0, p_valid: float | None = None) -> list[float]:
    """Each answer's validity score minus the mean over the *sampled* answers.

    A forced call is a valid answer the policy could have given; measured against what it
    did sample, it carries the format's credit too: positive while the sampled answers are
    often invalid, zero once they are all valid. Both forced calls get the same format
    credit, so it teaches the format and says nothing about the decision. (It is guidance,
    not an unbiased policy-gradient term: the calls were not sampled.)

    A group of forced calls alone (nothing sampled) measures them against the policy's exact
    expected validity score instead, from `p_valid`, its probability of writing one of the
    two calls exactly (a lower bound on its validity: other spellings may parse too).
    """
    scores = [format_bonus if a.valid else invalid_score for a in answers]
    sampled = [s for s, a in zip(scores, answers) if not a.forced]
    if sampled:
        mean = sum(sampled) / len(sampled)
    elif p_valid is not None:
        mean = p_valid * format_bonus + (1.0 - p_valid) * invalid_score
    else:
        mean = format_bonus
    return [weight * (s - mean) for s in scores]


def likelihood_format(weight: float, shares: Sequence[float]) -> list[float]:
    """The forced calls' format credit as the gradient of log P(one of the calls): `weight`
    times each call's share of the two (its p(a | a call)), on every token of it.

    On the tokens the calls share, the credits sum to `weight`: the likelihood of the call's
    common start. The gap credit (`validity_advantages`) is P(valid)'s gradient instead, and
    both calls get (1 - P(valid)) on every token, so near a learned format its pull fades as
    the square of what is left to learn, while here it fades linearly. At the action word the
    two tokens get weight * p(a | a call): their logits move apart only by the factor
    (1 / P(valid) - 1) toward the likelier call, so the decision is left to its own credit.
    """
    return [weight * s for s in shares]


def group_advantages(scores: Sequence[float], scale: bool = True) -> list[float]:
    """GRPO's scalar credit: score - group mean, divided by the group's std when `scale` (all
    zero when scores are equal). The trainer applies it to every token of a sequence that has
    no per-token advantages; fidelity.py reads it the same way."""
    n = len(scores)
    mean = sum(scores) / n
    centred = [s - mean for s in scores]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / std if std > 1e-8 else 0.0 for c in centred]


def hit_share(logprob_hit: float, logprob_stick: float) -> float:
    """P(hit | one of the two valid calls) from the log-probabilities of the two whole calls."""
    diff = logprob_stick - logprob_hit
    if diff > 700:
        return 0.0
    return 1.0 / (1.0 + math.exp(diff))


def call_probabilities(logprob_hit: float, logprob_stick: float) -> dict[int, float]:
    """The policy's probability of each valid call, renormalized over the two."""
    p_hit = hit_share(logprob_hit, logprob_stick)
    return {1: p_hit, 0: 1.0 - p_hit}


def decision_advantages(answers: Sequence[AnswerCredit], q: Sequence[float],
                        p_call: dict[int, float] | None, scale: bool = False, se_gap: float = 0.0,
                        forced_weight: str = "policy") -> list[float]:
    """The decision credit of each answer's action tokens (see the module docstring).

    `q` is (Q*(s, stick), Q*(s, hit)), or the rollouts' estimates with `se_gap` the standard
    error of their difference; `p_call` the policy's probabilities of the two forced calls,
    given when the group holds them; `scale` divides by the decision's spread. `forced_weight`
    says what a forced call gets, and so the gradient on the logit difference z_hit - z_stick:
    - policy: p(a) (Q(a) - V_p), the all-action gradient p_hit p_stick (Q(hit) - Q(stick)),
      zero at either sure policy, right or wrong;
    - none: Q(a) - V_p, the gradient (p_hit^2 + p_stick^2) (Q(hit) - Q(stick)), never under
      half the gap, even where the policy is already sure of the better call;
    - greedy: the better call gets |Q(hit) - Q(stick)|, the other nothing: the cross-entropy
      toward the better call, weighted by the gap, whose gradient (1 - p_better) |gap| fades
      only where the policy is right (classification-based policy iteration on estimates).
    """
    if scale:
        gap = max(abs(q[1] - q[0]), DECISION_SCALE_FLOOR, ESTIMATE_FLOOR_SE * se_gap)
        q = (q[0] / gap, q[1] / gap)
    counterfactual = any(a.forced for a in answers)
    if counterfactual and p_call is None:
        raise ValueError("a counterfactual group needs the policy's probabilities of the two calls")
    baseline = (q[0] + q[1]) / 2
    v_p = sum(p_call[a] * q[a] for a in (0, 1)) if p_call else baseline
    out = []
    for a in answers:
        if not a.valid or a.action is None:
            out.append(0.0)
        elif a.forced and forced_weight == "greedy":
            better = HIT if q[HIT] > q[STICK] else STICK
            out.append(abs(q[HIT] - q[STICK]) if a.action == better else 0.0)  # a tie: 0 for both
        elif a.forced:
            out.append((p_call[a.action] if forced_weight == "policy" else 1.0) * (q[a.action] - v_p))
        else:
            out.append(0.0 if counterfactual else q[a.action] - baseline)
    return out


def decision_pull(q: Sequence[float], p_call: dict[int, float], scale: bool = False, se_gap: float = 0.0,
                  forced_weight: str = "policy") -> float:
    """How hard a counterfactual group's decision credit pulls the logit difference z_hit - z_stick:
    each forced call's credit times d log p(call) / dz (p_stick for the hit call, -p_hit for the
    stick call), summed. Its sign is the better action's; `action_balance` weighs classes by it."""
    hit, stick = decision_advantages([AnswerCredit(True, HIT, True), AnswerCredit(True, STICK, True)], q, p_call,
                                     scale, se_gap, forced_weight)
    return hit * p_call[STICK] - stick * p_call[HIT]


def answer_token_advantages(n_tokens: int, action_tokens: Sequence[int], format_adv: float,
                            decision_adv: float) -> list[float]:
    """One answer's per-token advantages: format credit everywhere, plus the decision credit
    on its action tokens (the action word must also be a valid one: see the module docstring)."""
    out = [format_adv] * n_tokens
    for i in action_tokens:
        if 0 <= i < n_tokens:
            out[i] = format_adv + decision_adv
    return out


def spread(masks: Sequence[int], masked: int, per_answer: Sequence[Sequence[float]]) -> list[float]:
    """A sequence's advantages: each trained span (one per answer, in order) gets its
    answer's values; context positions get 0."""
    out = [0.0] * len(masks)
    k, i = 0, 0
    while i < len(masks):
        if masks[i] == masked:
            i += 1
            continue
        j = i
        while j < len(masks) and masks[j] != masked:
            j += 1
        values = per_answer[k] if k < len(per_answer) else []
        for t in range(i, j):
            out[t] = values[t - i] if t - i < len(values) else (values[-1] if values else 0.0)
        k += 1
        i = j
    return out


def token_advantages(sequences: Sequence[Trajectory], answers: Sequence[Sequence[AnswerAdvantage]],
                     formats: Sequence[float], decode: Callable[[Sequence[int]], str]) -> list[list[float]]:
    """Per-token advantages of a group's sequences: each trained span (one per answer, in
    order) carries its sequence's format credit, and its action word also the answer's
    decision credit; context positions carry 0. Whole-episode and step groups differ only in
    the credits they pass."""
    rows = []
    for seq, seq_answers, fmt in zip(sequences, answers, formats):
        per_answer = []
        for (start, end), answer in zip(trained_spans(seq.masks), seq_answers):
            ids = seq.tokens[start:end]
            action = action_token_indices(ids, action_char_span(answer.text), decode) if answer.valid else []
            per_answer.append(answer_token_advantages(len(ids), action, fmt, answer.decision))
        rows.append(spread(seq.masks, MASKED, per_answer))
    return rows
