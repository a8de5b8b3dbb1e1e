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

Two options make the decision signal exact (see credit.py):
- `token_advantages`: each group also carries per-token `advantages`, the format of an
  answer credited apart from its decision;
- `counterfactual`: each group also holds both valid calls, forced, scored by Q* and
  carrying the policy's own logprobs of them, so the decision gets the all-action policy
  gradient whatever the sampler drew. It needs a policy that can score given answers
  (`answer_logprobs`): the embedded llama.cpp model and the torch model can; chat servers
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
from typing import Literal

from .credit import (
    AnswerCredit,
    action_char_span,
    action_token_indices,
    answer_token_advantages,
    call_probabilities,
    decision_advantages,
    spread,
    validity_advantages,
)
from .env import BlackjackEnv
from .episode import sampling_seed, without_thoughts
from .game import Observation
from .grid import balanced_start
from .groups import GroupResult, Player
from .policies.base import Reply, Turn, answers_at_once
from .protocol import ACTION_NAMES, HIT, STICK, parse_action, tool_call_text
from .records import GROUP_BY_STEP, DropReason, ScoredDataGroup, Status, StepRecord
from .tokens import MASKED, Trajectory

FORCED = (HIT, STICK)  # the order in which a counterfactual group appends the two calls

ContinueWith = Literal["sampled", "best"]


@dataclass
class StepDeal:
    """A canonical episode and the groups sampled along it."""

    seed: int
    groups: list[GroupResult] = field(default_factory=list)
    status: Status = Status.FINISHED
    reward: float | None = None
    error: str | None = None


async def _sample(player: Player, turn: Turn, n: int, limiter: asyncio.Semaphore | None) -> list[Reply]:
    replies = await answers_at_once(player.policy, turn, n)
    if replies is not None:
        return replies

    async def one(i: int) -> Reply:
        t = Turn(turn.messages, turn.prompt_ids, turn.observation, turn.natural, sampling_seed(turn.seed, i, 0))
        if limiter is None:
            return await player.policy.respond(t)
        async with limiter:
            return await player.policy.respond(t)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def play_step_groups(
    player: Player,
    seed: int,
    group_size: int,
    *,
    continue_with: ContinueWith = "sampled",
    drop_equal_scores: bool = False,
    limiter: asyncio.Semaphore | None = None,
    counterfactual: bool = False,
    token_advantages: bool = False,
    scale_decisions: bool = False,
    format_weight: float = 1.0,
    starts: str = "deal",
    first_only: bool = False,
) -> StepDeal:
    settings, chat, solution = player.settings, player.chat, player.solution
    deal = StepDeal(seed)
    table = player.tables.acquire()
    env = BlackjackEnv(solution, settings, table)  # the canonical episode: the one game loop
    try:
        start = Observation(*balanced_start(seed, solution)) if starts == "chart" else None
        messages, _ = env.reset(seed, start=start)
        context = Trajectory()
        context.add_context(chat.prompt_ids(messages))
        while True:
            turn_index = env.turn
            if settings.thinking and len(context) + settings.max_new_tokens > settings.max_token_length:
                messages, context = without_thoughts(messages, chat)
            if len(context) + settings.max_new_tokens > settings.max_token_length:
                deal.status = Status.TRUNCATED
                return deal
            obs, natural = env.observation, env.natural
            prompt = list(context.tokens)
            turn = Turn(messages, prompt, obs, natural, sampling_seed(seed, 0, turn_index) ^ 0x5EED)
            try:
                replies = await _sample(player, turn, group_size, limiter) if group_size else []
            except Exception as exc:  # no answers: the deal fails; groups already made stay valid
                deal.status, deal.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
                return deal
            q = solution.q_values(obs, natural)
            best = solution.best_action(obs, natural)
            parsed = [parse_action(r.text, r.tool_calls) for r in replies]
            p_call = p_valid = None
            if counterfactual:
                try:
                    forced, p_call, p_valid = await _forced_replies(player, prompt)
                except Exception as exc:  # no logprobs of the calls: the deal fails, like a failed answer
                    deal.status, deal.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
                    return deal
                replies = [*replies, *forced]
                parsed = [*parsed, *(parse_action(r.text) for r in forced)]
            scores = [
                (q[p.action] + settings.format_bonus) if p.valid else settings.invalid_score for p in parsed
            ]
            sequences = [_sequence(prompt, r, chat) for r in replies]
            credits = [AnswerCredit(p.valid, p.action, i >= group_size) for i, p in enumerate(parsed)]
            group = ScoredDataGroup(
                tokens=[t.tokens for t in sequences],
                masks=[t.masks for t in sequences],
                inference_logprobs=[t.logprobs for t in sequences],
                scores=scores,
                messages=[[*messages, {"role": "assistant", "content": r.text}] for r in replies],
                generation_params={**player.policy.generation_params(), "group_by": GROUP_BY_STEP},
                episodes=[
                    StepRecord(
                        seed=seed,
                        decision=turn_index,
                        index=i,
                        state=[obs.player_sum, obs.dealer_card, int(obs.usable_ace)],
                        natural=natural,
                        action=ACTION_NAMES.get(p.action) if p.valid else None,
                        optimal=ACTION_NAMES[best],
                        q={"stick": q[0], "hit": q[1]},
                        invalid_reason=p.error.value if p.error else None,
                        score=scores[i],
                        forced=credits[i].forced,
                    )
                    for i, p in enumerate(parsed)
                ],
            )
            if counterfactual:
                group.generation_params["counterfactual"] = True
                group.episodes[0].p_call = {"hit": p_call[HIT], "stick": p_call[STICK]}
                group.episodes[0].p_valid = p_valid
            if token_advantages or counterfactual:
                group.advantages = _advantages(sequences, replies, credits, q, p_call, settings, chat,
                                               scale_decisions, format_weight, p_valid)
            dropped = drop_equal_scores and len(set(scores)) == 1 and len(scores) > 1
            deal.groups.append(GroupResult(seed, [], None if dropped else group,
                                           DropReason.EQUAL_SCORES if dropped else None))
            if first_only:  # the deal's one group; the game is not played on
                return deal

            if group_size == 0:  # the policy's own choice between the two calls, at its temperature
                pick = FORCED.index(best) if continue_with == "best" else _choose(p_call, turn.seed)
            else:  # never a forced call
                pick = max(range(group_size), key=lambda i: scores[i]) if continue_with == "best" else 0
            chosen = replies[pick]
            # the canonical episode plays the chosen answer (never re-prompted: its group already scored it)
            text, _, terminated, truncated, _ = env.step(chosen.text, chosen.tool_calls, allow_retry=False)
            if env.play.status == Status.INVALID:
                deal.status = Status.INVALID
                return deal
            if terminated:
                deal.reward = env.play.reward
                return deal
            messages = [*messages, {"role": "assistant", "content": chosen.text}, {"role": "user", "content": text}]
            context.add_context(sequences[pick].tokens[len(prompt):])
            context.add_context(chat.next_turn_ids(text))
            if truncated:  # the turn limit
                deal.status = Status.TRUNCATED
                return deal
    finally:
        player.tables.release(table)


def _sequence(prompt: list[int], reply: Reply, chat) -> Trajectory:
    t = Trajectory()
    t.add_context(prompt)
    if reply.completion_ids is not None:
        t.add_sampled(reply.completion_ids, reply.logprobs)
        if reply.finish_reason == "length":
            t.add_context(chat.end_of_turn_ids)
    else:
        t.add_sampled(chat.answer_ids(reply.text), None)
    return t


def _choose(p_call: dict[int, float], seed: int) -> int:
    """Index (into FORCED) of the call drawn with the policy's probabilities, reproducibly."""
    return FORCED.index(HIT) if random.Random(seed).random() < p_call[HIT] else FORCED.index(STICK)


async def _forced_replies(player: Player, prompt: list[int]) -> tuple[list[Reply], dict[int, float], float]:
    """Both valid calls as answers, with the policy's own logprobs of every token; the
    policy's probabilities of each among the two, and of writing either one exactly."""
    answer_logprobs = getattr(player.policy, "answer_logprobs", None)
    if answer_logprobs is None:
        raise ValueError(
            f"counterfactual groups need the policy's logprobs of given answers; {player.policy.name} "
            "cannot give them (use the embedded or torch policy)"
        )
    texts = [tool_call_text(a) for a in FORCED]
    ids = [player.chat.answer_ids(t) for t in texts]
    logprobs = await answer_logprobs(prompt, ids)
    replies = [Reply(text=t, completion_ids=i, logprobs=lp) for t, i, lp in zip(texts, ids, logprobs)]
    p_valid = min(1.0, sum(math.exp(sum(lp)) for lp in logprobs))
    return replies, call_probabilities(sum(logprobs[0]), sum(logprobs[1])), p_valid


def _advantages(sequences, replies, credits, q, p_call, settings, chat, scale_decisions=False,
                format_weight=1.0, p_valid=None) -> list[list[float]]:
    """Per-token advantages of a step group's sequences (shared prompt: 0; answer: credit.py)."""
    fmt = validity_advantages(credits, settings.invalid_score, settings.format_bonus, format_weight, p_valid)
    dec = decision_advantages(credits, q, p_call, scale_decisions)
    out = []
    for seq, reply, credit, f, d in zip(sequences, replies, credits, fmt, dec):
        answer = [t for t, m in zip(seq.tokens, seq.masks) if m != MASKED]
        action = action_token_indices(answer, action_char_span(reply.text), chat.backend.decode) if credit.valid else []
        row = spread(seq.masks, MASKED, [answer_token_advantages(len(answer), action, f, d)])
        out.append(row)
    return out
