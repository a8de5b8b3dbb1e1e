"""Step groups: one GRPO group per decision, scored by Q* instead of by the cards.

At each decision of a canonical episode, `group_size` answers are sampled from the
byte-identical prompt (the conversation so far). Each answer is scored by
Q*(state, its action), an expectation over unseen cards, so two answers that make the
same choice score the same and a better choice always scores higher; an invalid answer
gets the invalid score. Each sequence is the shared prompt plus one answer, and only
that answer is trained: the format trainers that take the shared prefix as the prompt
and ignore masks expect (Axolotl, verl). The canonical episode then continues with one
of the answers: a sampled one (on-policy states) or the best one.

This is what the Atropos "thinking" variant meant, without its flaws: it valued
answers by replaying the seeded deck (seeing the future), trained on environment text
and used non-standard roles.

Two credit modes make the decision signal exact (see credit.py):
- `step-tokens`: each group also carries per-token `advantages`, the format of an
  answer credited apart from its decision;
- `step-counterfactual`: each group also holds both valid calls, forced, scored by Q* and
  carrying the policy's own logprobs of them, so the decision gets the all-action policy
  gradient whatever the sampler drew. It needs a policy that can score given answers
  (`ScoresAnswers`): the embedded llama.cpp model and the torch model can; chat servers
  cannot (they return no logprobs of a given answer), nor can bots (no probabilities).
  With `group_size` 0 a group holds the two calls only: nothing is sampled, the canonical
  episode continues with a call drawn from the policy's own probabilities of the two, and
  the calls' format is measured against the policy's exact probability of writing one.
  Decisions then cost one scoring forward instead of a sampled answer, so a step can
  cover many more states; the format is still learned, but whether free sampling at the
  end is valid is measured only by `evaluate`.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field

from blackjack_rl.config import GroupConfig
from blackjack_rl.contract.protocol import ACTION_NAMES, HIT, STICK, parse_action, tool_call_text
from blackjack_rl.contract.records import GROUP_BY_STEP, DropReason, ScoredDataGroup, Status, StepRecord
from blackjack_rl.contract.tokens import Trajectory
from blackjack_rl.env import BlackjackEnv
from blackjack_rl.game.solver import GRID_STATES, GridKey, Solution
from blackjack_rl.game.table import Observation
from blackjack_rl.policies.base import Reply, ScoresAnswers, Turn
from blackjack_rl.rollout.core import Conversation, GroupResult, answered, pack_group, replies_at
from blackjack_rl.rollout.credit import (
    AnswerAdvantage,
    AnswerCredit,
    call_probabilities,
    decision_advantages,
    likelihood_format,
    token_advantages,
    validity_advantages,
)
from blackjack_rl.rollout.episodes import sampling_seed
from blackjack_rl.rollout.estimates import CallMemo, estimate_q
from blackjack_rl.rollout.players import Player

FORCED = (HIT, STICK)  # the order in which a counterfactual group appends the two calls


@dataclass
class StepDeal:
    """A canonical episode and the groups sampled along it."""

    seed: int
    groups: list[GroupResult] = field(default_factory=list)
    status: Status = Status.FINISHED
    reward: float | None = None
    error: str | None = None


@dataclass
class _Decision:
    """The answers at one decision of the canonical episode, and the group made of them."""

    replies: list[Reply]
    sequences: list[Trajectory]
    scores: list[float]
    p_call: dict[int, float] | None
    seed: int  # the turn's sampling seed
    group: ScoredDataGroup


class NoAnswers(Exception):
    """No answers could be had at a decision: the deal fails, its earlier groups stay valid."""


async def play_step_groups(player: Player, seed: int, config: GroupConfig,
                           limiter: asyncio.Semaphore | None = None, memo: CallMemo | None = None) -> StepDeal:
    deal = StepDeal(seed)
    table = player.tables.acquire()
    env = BlackjackEnv(player.solution, player.settings, table)  # the canonical episode: the one game loop
    try:
        start = chart_start(seed, player.solution, config.starts)
        game = Conversation()
        game.open(env.reset(seed, start=start)[0], player.chat)
        while True:
            if not game.make_room(player.settings, player.chat):
                deal.status = Status.TRUNCATED
                return deal
            try:
                decision = await _decide(player, config, env, game, limiter, memo)
            except NoAnswers as exc:
                deal.status, deal.error = Status.FAILED, str(exc)
                return deal
            dropped = config.drop_equal_scores and len(set(decision.scores)) == 1 and len(decision.scores) > 1
            deal.groups.append(GroupResult(seed, [], None if dropped else decision.group,
                                           DropReason.EQUAL_SCORES if dropped else None))
            if config.decisions == "first":  # the deal's one group; the game is not played on
                return deal
            if _play_on(player, config, env, game, decision, deal):
                return deal
    finally:
        player.tables.release(table)


async def _decide(player: Player, config: GroupConfig, env: BlackjackEnv, game: Conversation,
                  limiter: asyncio.Semaphore | None, memo: CallMemo | None) -> _Decision:
    """The group at the canonical episode's decision: sampled answers (and the forced calls)."""
    settings, solution, n = player.settings, player.solution, config.group_size
    obs, natural, prompt = env.observation, env.natural, list(game.trajectory.tokens)
    turn = Turn(game.messages, prompt, obs, natural, sampling_seed(env.play.seed, 0, env.turn) ^ 0x5EED)
    p_call = p_valid = None
    try:
        replies = await replies_at(player.policy, turn, n, limiter, lambda i: sampling_seed(turn.seed, i, 0)) if n else []
        if config.counterfactual:
            forced, p_call, p_valid = await _forced_replies(player, prompt)
            replies = [*replies, *forced]
    except Exception as exc:
        raise NoAnswers(f"{type(exc).__name__}: {exc}") from exc
    q, best = solution.q_values(obs, natural), solution.best_action(obs, natural)
    estimate = None
    if config.credit == "step-rollouts":  # the credit's values come from the table alone; Q* stays on the record
        estimate = await estimate_q(player, memo or CallMemo(), prompt, env.table.player_hand, obs, env.play.seed,
                                    env.turn, config.rollouts, config.rollout_continuation)
    credit_q = estimate.q if estimate is not None else q
    parsed = [parse_action(r.text, r.tool_calls) if i < n else parse_action(r.text) for i, r in enumerate(replies)]
    scores = [(credit_q[p.action] + settings.format_bonus) if p.valid else settings.invalid_score for p in parsed]
    sequences = [answered(prompt, r, player.chat) for r in replies]
    credits = [AnswerCredit(p.valid, p.action, i >= n) for i, p in enumerate(parsed)]
    records = [
        StepRecord(seed=env.play.seed, decision=env.turn, index=i, state=[obs.player_sum, obs.dealer_card, int(obs.usable_ace)],
                   natural=natural, action=ACTION_NAMES.get(p.action) if p.valid else None, optimal=ACTION_NAMES[best],
                   q={"stick": q[0], "hit": q[1]}, invalid_reason=p.error.value if p.error else None, score=scores[i],
                   forced=credits[i].forced)
        for i, p in enumerate(parsed)
    ]
    group = pack_group(sequences, scores, [[*game.messages, {"role": "assistant", "content": r.text}] for r in replies],
                       records, {**player.policy.generation_params(), "group_by": GROUP_BY_STEP})
    if config.counterfactual:
        group.generation_params["counterfactual"] = True
        if config.forced_weight != "policy":
            group.generation_params["forced_weight"] = config.forced_weight
        if config.format_credit != "gap":
            group.generation_params["format_credit"] = config.format_credit
        group.episodes[0].p_call = {"hit": p_call[HIT], "stick": p_call[STICK]}
        group.episodes[0].p_valid = p_valid
    if env.turn:
        group.episodes[0].history = [list(d.state) for d in env.play.decisions]
    if estimate is not None:
        group.generation_params.update(rollouts=estimate.k, rollout_continuation=config.rollout_continuation,
                                       rollout_refresh=config.rollout_refresh)
        group.episodes[0].q_estimate = {"stick": estimate.q_stick, "hit": estimate.q_hit, "se_gap": estimate.se_gap}
        group.episodes[0].rollouts = estimate.k
    if config.token_advantages:
        formats = validity_advantages(credits, settings.invalid_score, settings.format_bonus, config.format_weight, p_valid)
        if config.format_credit == "likelihood" and p_call is not None:
            formats[n:] = likelihood_format(config.format_weight, [p_call[a] for a in FORCED])
        decisions = decision_advantages(credits, credit_q, p_call, config.scale_decisions,
                                        estimate.se_gap if estimate is not None else 0.0,
                                        config.forced_weight)
        answers = [[AnswerAdvantage(r.text, c.valid, d)] for r, c, d in zip(replies, credits, decisions)]
        group.advantages = token_advantages(sequences, answers, formats, player.chat.backend.decode)
    return _Decision(replies, sequences, scores, p_call, turn.seed, group)


def _play_on(player: Player, config: GroupConfig, env: BlackjackEnv, game: Conversation, decision: _Decision,
             deal: StepDeal) -> bool:
    """The canonical episode plays one of the decision's answers; True when the deal is over.

    The answer is never re-prompted: its group already scored it. Without sampled answers the
    policy's own choice between the two calls is drawn, at its temperature; else the first
    sampled answer (on-policy states) or the best one, never a forced call.
    """
    obs, natural = env.observation, env.natural
    if config.group_size == 0:
        best = player.solution.best_action(obs, natural)
        pick = FORCED.index(best) if config.continue_with == "best" else _choose(decision.p_call, decision.seed)
    else:
        sampled = range(config.group_size)
        pick = max(sampled, key=lambda i: decision.scores[i]) if config.continue_with == "best" else 0
    chosen = decision.replies[pick]
    prompt_length = len(game.trajectory)
    text, _, terminated, truncated, _ = env.step(chosen.text, chosen.tool_calls, allow_retry=False)
    if env.play.status == Status.INVALID:
        deal.status = Status.INVALID
        return True
    if terminated:
        deal.reward = env.play.reward
        return True
    game.messages = [*game.messages, {"role": "assistant", "content": chosen.text}]
    game.trajectory.add_context(decision.sequences[pick].tokens[prompt_length:])
    game.add_user(text, player.chat)
    if truncated:  # the turn limit
        deal.status = Status.TRUNCATED
        return True
    return False


def _choose(p_call: dict[int, float], seed: int) -> int:
    """Index (into FORCED) of the call drawn with the policy's probabilities, reproducibly."""
    return FORCED.index(HIT) if random.Random(seed).random() < p_call[HIT] else FORCED.index(STICK)


async def _forced_replies(player: Player, prompt: list[int]) -> tuple[list[Reply], dict[int, float], float]:
    """Both valid calls as answers, with the policy's own logprobs of every token; the
    policy's probabilities of each among the two, and of writing either one exactly."""
    if not isinstance(player.policy, ScoresAnswers):
        raise ValueError(
            f"counterfactual groups need the policy's logprobs of given answers; {player.policy.name} "
            "cannot give them (use the embedded or torch policy)"
        )
    texts = [tool_call_text(a) for a in FORCED]
    ids = [player.chat.answer_ids(t) for t in texts]
    logprobs = await player.policy.answer_logprobs(prompt, ids)
    replies = [Reply(text=t, completion_ids=i, logprobs=lp) for t, i, lp in zip(texts, ids, logprobs)]
    p_valid = min(1.0, sum(math.exp(sum(lp)) for lp in logprobs))
    return replies, call_probabilities(sum(logprobs[0]), sum(logprobs[1])), p_valid


def chart_start(seed: int, solution: Solution, starts: str) -> Observation | None:
    """Where a deal of step groups starts: where its cards put it (None), a balanced chart state,
    or a chart state drawn uniformly (reward only: the solver never chooses it)."""
    if starts == "chart":
        return Observation(*balanced_start(seed, solution))
    if starts == "uniform":
        return random.Random(seed ^ 0x57A27).choice(GRID_STATES)
    return None


def balanced_start(seed: int, solution: Solution) -> GridKey:
    """An exploring start: a chart state where hitting is optimal or one where sticking is,
    with equal chance, uniform within each (reproducibly from `seed`).

    The dealt hands repeat a few totals (hard 12-17) and their decisions lean to one action,
    so a policy that cannot yet tell hands apart would learn one shared preference first
    (docs/training/ has the runs that showed it).
    """
    rng = random.Random(seed ^ 0x57A27)
    hit = [k for k in GRID_STATES if solution.best_action(k) == HIT]
    stick = [k for k in GRID_STATES if solution.best_action(k) != HIT]
    return rng.choice(hit if rng.random() < 0.5 else stick)
