"""Reward-only decision credit: Q^pi(h, hit) and Q^pi(h, stick) estimated by playing the table.

The solver's Q* is exact but imitating it is imitation; a game that cannot be solved gives only
rewards. Here both actions are played from the decision K times, and each action's value is the
mean of the rewards it got: nothing of the solver enters, only what `Table` pays.

- **Common random numbers, aligned.** Rollout k resumes the hand with the table's two card
  streams (player, dealer) seeded by (deal, decision, k), for both actions: the stick and the hit
  see the same dealer hole card and the same dealer draws, and the hit the same player cards.
  Their difference then varies only where the actions truly differ.
- **Fresh hidden cards per k.** Each k draws the hole card and every later card anew.
- **The continuation** after a hit is the policy being trained, through its probabilities of the
  two calls at the history prompt (the canonical hit call, then the new hand), not a sample:
  on rollout k's cards the hand's value is P(stick) * (the stick's reward) + P(hit) * (the next
  hit's value) + P(invalid) * the invalid score. The invalid mass is a forfeit, never
  renormalised away. A bot continues with its exact P(hit). With `continuation` "chart" the
  model is asked at the new hand's opening prompt instead (a Markov projection of the policy,
  labelled as such wherever it is used): those 280 prompts repeat, where histories do not.

The estimate is of the policy's own Q^pi at the history, whose expectation over k is exact.
Repeated continuation prompts are scored once per memo (a training step: the weights change
between steps).

**A snapshot continuation** (`chart_snapshot`): the chart continuation's 280 opening prompts
scored once and held for several training steps. The credit then values both actions under a
fixed continuation policy, so its target stands still while the trained decisions move toward
it, and moves on at the next snapshot: approximate policy iteration. With the current policy
continuing instead, the target moves with every step (hitting is worth little while the
policy hits too often, and the reverse), a feedback loop the solver's Q* does not have.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

from blackjack_rl.contract.protocol import HIT, STICK, observation_text, tool_call_text
from blackjack_rl.game.solver import GRID_STATES
from blackjack_rl.game.table import Observation, Table
from blackjack_rl.policies.base import KnowsItsPolicy, ScoresAnswers
from blackjack_rl.rollout.episodes import opening_messages
from blackjack_rl.rollout.players import Player

MEMO_LIMIT = 20_000  # continuation prompts kept before the memo starts over (a step needs far fewer)
MAX_HITS = 12  # hits a continuation may take: more than any hand of 21 can (4 aces, 4 twos, 3 threes...)


@dataclass(frozen=True, slots=True)
class QEstimate:
    """Both actions' mean reward over `k` rollouts, and what it cost."""

    q_stick: float
    q_hit: float
    k: int
    continuation_prompts: int  # distinct history prompts the continuation needed
    se_gap: float = 0.0  # standard error of q_hit - q_stick, from the k paired differences (0 when k = 1)

    @property
    def q(self) -> tuple[float, float]:
        """(Q(stick), Q(hit)), the order of `Solution.q_values`."""
        return self.q_stick, self.q_hit


@dataclass
class CallMemo:
    """The policy's (P(hit call), P(stick call)) at history prompts, each prompt scored once;
    concurrent asks for the same prompt share one scoring."""

    entries: dict[tuple[int, ...], asyncio.Future[tuple[float, float]]] = field(default_factory=dict)
    scored: int = 0  # prompts the policy scored (memo misses)

    def clear(self) -> None:
        self.entries.clear()


def rollout_seed(deal: int, decision: int, k: int) -> list[int]:
    """The card streams' key of rollout k at a decision of a deal."""
    return [deal & 0xFFFFFFFFFFFFFFFF, decision, k]


async def chart_snapshot(player: Player, memo: CallMemo) -> dict[Observation, tuple[float, float]]:
    """The policy's (P(hit call), P(stick call)) at every chart cell's opening prompt, now
    (scored through `memo`, which counts them)."""
    observations = list(GRID_STATES)  # every hand a hit can lead to is a chart cell
    prompts = [_opening_ids(player, o) for o in observations]
    return dict(zip(observations, await _call_probabilities(player, memo, prompts, observations)))


def _opening_ids(player: Player, obs: Observation) -> list[int]:
    """The chart continuation's prompt for a hand: its opening prompt, as at a first decision."""
    return player.chat.prompt_ids(opening_messages(obs, player.settings.thinking))


def snapshot_memo(player: Player, snapshot: dict[Observation, tuple[float, float]]) -> CallMemo:
    """A memo that answers every chart continuation prompt from `snapshot` (call it in the event
    loop that will await it)."""
    loop, memo = asyncio.get_running_loop(), CallMemo()
    for obs, probs in snapshot.items():
        future = loop.create_future()
        future.set_result(probs)
        memo.entries[tuple(_opening_ids(player, obs))] = future
    return memo


async def estimate_q(player: Player, memo: CallMemo, prompt: Sequence[int], hand: list[int], observation: Observation,
                     deal: int, decision: int, k: int, continuation: str = "history") -> QEstimate:
    """Q^pi(h, stick) and Q^pi(h, hit) at the decision whose prompt is `prompt` (answers so far:
    `decision`), from `k` rollouts of the hand `hand` against the dealer's up card.

    `continuation` "chart" asks the policy after a hit at the new hand's opening prompt instead
    of the game's: the value of the policy's Markov projection (the chart it plays at first
    decisions, applied at every decision), not of the policy itself."""
    if k < 1:
        raise ValueError(f"rollouts must be at least 1, got {k}")
    table = player.tables.acquire()
    try:
        paths = [_card_path(table, hand, observation.dealer_card, rollout_seed(deal, decision, i)) for i in range(k)]
    finally:
        player.tables.release(table)
    hit_ids = player.chat.answer_ids(tool_call_text(HIT))
    prompts: dict[tuple[Observation, ...], list[int]] = {}
    chart = continuation == "chart"
    openings: dict[Observation, list[int]] = {}  # a chart prompt is rendered once per hand, not once per path
    for path in paths:
        ids = list(prompt)
        for depth, obs in enumerate(path.hands, start=1):
            if decision + depth >= player.settings.max_turns:
                break  # the turn limit ends the game after this hit: no prompt is asked
            history = path.hands[:depth]
            if history in prompts and chart:
                continue
            if chart:
                ids = openings.get(obs) or openings.setdefault(obs, _opening_ids(player, obs))
            else:
                ids = [*ids, *hit_ids, *player.chat.next_turn_ids(observation_text(*obs))]
            prompts.setdefault(history, ids)
    keys = list(prompts)
    probs = dict(zip(keys, await _call_probabilities(player, memo, [prompts[h] for h in keys], [h[-1] for h in keys])))
    settings = player.settings
    stick = [p.stick_rewards[0] for p in paths]
    hit = [_hit_value(p, probs, decision, settings.max_turns, settings.invalid_score) for p in paths]
    return QEstimate(math.fsum(stick) / k, math.fsum(hit) / k, k, len(keys), _standard_error(hit, stick))


def _standard_error(hit: list[float], stick: list[float]) -> float:
    """The standard error of mean(hit) - mean(stick) over paired rollouts (common cards)."""
    k = len(hit)
    if k < 2:
        return 0.0
    diffs = [h - s for h, s in zip(hit, stick)]
    mean = math.fsum(diffs) / k
    return math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (k - 1) / k)


@dataclass(frozen=True, slots=True)
class _CardPath:
    """One rollout's cards seen from the decision: the hands after each hit (until a bust) and
    the stick's reward at the decision and at each of those hands."""

    hands: tuple[Observation, ...]
    stick_rewards: tuple[float, ...]  # at the decision, then after 1, 2, ... hits
    busts: bool  # the last hit of the path busted (else it stopped at MAX_HITS)


def _card_path(table: Table, hand: list[int], dealer_card: int, seed: list[int]) -> _CardPath:
    """Rollout `seed` from the decision: the stick at once, after one hit, after two... each on
    the same cards in the same roles (`Table.hit_path`)."""
    hands, rewards, busts = table.hit_path(hand, dealer_card, seed, MAX_HITS)
    return _CardPath(tuple(hands), tuple(rewards), busts)


def _hit_value(path: _CardPath, probs: dict[tuple[Observation, ...], tuple[float, float]], decision: int,
               max_turns: int, invalid_score: float) -> float:
    """The hit's reward on this path's cards, the policy continuing with its probabilities."""
    value = -1.0  # a path that ends busts on its next hit
    if not path.busts:
        value = invalid_score  # MAX_HITS hits without a bust: no hand gets there; kept sound anyway
    for depth in range(len(path.hands), 0, -1):
        if decision + depth >= max_turns:  # this hit was the last allowed answer: truncated
            value = invalid_score
            continue
        p_hit, p_stick = probs[path.hands[:depth]]
        p_invalid = max(0.0, 1.0 - p_hit - p_stick)
        value = p_stick * path.stick_rewards[depth] + p_hit * value + p_invalid * invalid_score
    return value


async def _call_probabilities(player: Player, memo: CallMemo, prompts: list[list[int]],
                              observations: list[Observation]) -> list[tuple[float, float]]:
    """(P(hit call), P(stick call)) at each prompt: a bot's exact policy, a model's probability of
    each canonical call, whole (0 for a prompt whose answer would not fit the token budget: the
    episode ends truncated, scored like invalid)."""
    policy = player.policy
    if isinstance(policy, KnowsItsPolicy):
        return [(h, 1.0 - h) for h in (float(policy.hit_probability(o, False)) for o in observations)]
    if not isinstance(policy, ScoresAnswers):
        raise ValueError(f"rollout credit continues with the policy's probabilities of the two calls; "
                         f"{policy.name} cannot give them (use the embedded or torch policy, or a bot)")
    if len(memo.entries) > MEMO_LIMIT:
        memo.clear()
    keys = [tuple(p) for p in prompts]
    loop = asyncio.get_running_loop()
    mine = []
    for key in dict.fromkeys(keys):
        if key not in memo.entries:
            memo.entries[key] = loop.create_future()
            mine.append(key)
    if mine:
        await _score_into(player, memo, mine)
    return [await memo.entries[k] for k in keys]


async def _score_into(player: Player, memo: CallMemo, keys: list[tuple[int, ...]]) -> None:
    settings, chat = player.settings, player.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(STICK))]
    fits = [k for k in keys if len(k) + settings.max_new_tokens <= settings.max_token_length]
    try:
        scored = await player.policy.answer_logprobs_many([(list(k), calls) for k in fits]) if fits else []
    except BaseException as exc:
        for k in keys:
            memo.entries.pop(k).set_exception(exc)
        raise
    memo.scored += len(fits)
    got = {k: (math.exp(sum(lp_hit)), math.exp(sum(lp_stick))) for k, (lp_hit, lp_stick) in zip(fits, scored)}
    for k in keys:
        memo.entries[k].set_result(got.get(k, (0.0, 0.0)))
