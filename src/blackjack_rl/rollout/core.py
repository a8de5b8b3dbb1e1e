"""The rollout core: a game as the model sees it, answers at its state, and a group packed.

Whole-episode groups (groups.py) and step groups (stepgroups.py) are both built from these
pieces, so the token budget, how a reply becomes trained tokens, the concurrency limit and
the packing of a group exist once. Per-token credit is credit.py's `token_advantages`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

from blackjack_rl.contract.protocol import split_thinking
from blackjack_rl.contract.records import DropReason, EpisodeRecord, ScoredDataGroup, StepRecord
from blackjack_rl.contract.tokens import MASKED, ChatFormat, Trajectory
from blackjack_rl.env import BlackjackEnv, EnvSettings
from blackjack_rl.policies.base import Policy, Reply, Turn, answers_at_once

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EpisodeSettings(EnvSettings):
    """The game's settings plus the token budget, which only a player that tokenizes can keep."""

    max_token_length: int = 1024
    max_new_tokens: int = 64


@dataclass
class Conversation:
    """A game as the model sees it: the messages so far and their token ids, trained or not."""

    messages: list[dict[str, str]] = field(default_factory=list)
    trajectory: Trajectory = field(default_factory=Trajectory)
    thoughts_truncated: int = 0  # model turns whose earlier thoughts were cut to fit the budget

    def open(self, messages: list[dict[str, str]], chat: ChatFormat) -> None:
        self.messages = messages
        self.trajectory.add_context(chat.prompt_ids(messages))

    def make_room(self, settings: EpisodeSettings, chat: ChatFormat) -> bool:
        """Whether one more answer fits the token budget; in thinking mode earlier thoughts are
        cut first when it would not."""
        over = len(self.trajectory) + settings.max_new_tokens > settings.max_token_length
        if over and settings.thinking:
            self.messages, self.trajectory = without_thoughts(self.messages, chat)
            self.thoughts_truncated += 1
        return len(self.trajectory) + settings.max_new_tokens <= settings.max_token_length

    def turn(self, env: BlackjackEnv, seed: int) -> Turn:
        return Turn(self.messages, self.trajectory.tokens, env.observation, env.natural, seed)

    def add_user(self, text: str, chat: ChatFormat) -> None:
        self.messages.append({"role": "user", "content": text})
        self.trajectory.add_context(chat.next_turn_ids(text))


def add_answer(trajectory: Trajectory, reply: Reply, chat: ChatFormat) -> None:
    """A reply's tokens, trained: the ids the policy sampled with their logprobs, or, from a
    policy that gives no ids (a bot, a chat server), the template's tokens of its text."""
    if reply.completion_ids is not None:
        trajectory.add_sampled(reply.completion_ids, reply.logprobs)
        if reply.finish_reason == "length":  # the model did not close its turn; the template does
            trajectory.add_context(chat.end_of_turn_ids)
    else:
        trajectory.add_sampled(chat.answer_ids(reply.text), None)


def answered(prompt: list[int], reply: Reply, chat: ChatFormat) -> Trajectory:
    """One sequence of a step group: the shared prompt as context, then the reply, trained."""
    t = Trajectory()
    t.add_context(prompt)
    add_answer(t, reply, chat)
    return t


async def limited(limiter: asyncio.Semaphore | None, make: Callable[[], Awaitable[T]]) -> T:
    """`make()` under the concurrency limit, taken once and never nested (no deadlock)."""
    if limiter is None:
        return await make()
    async with limiter:
        return await make()


async def replies_at(policy: Policy, turn: Turn, n: int, limiter: asyncio.Semaphore | None,
                     seed_of: Callable[[int], int]) -> list[Reply]:
    """n answers at one state: one request when the policy can, else one each (seed `seed_of(i)`)."""
    replies = await answers_at_once(policy, turn, n)
    if replies is not None:
        return replies

    def one(i: int) -> Callable[[], Awaitable[Reply]]:
        return lambda: policy.respond(Turn(turn.messages, turn.prompt_ids, turn.observation, turn.natural, seed_of(i)))

    return list(await asyncio.gather(*(limited(limiter, one(i)) for i in range(n))))


@dataclass
class GroupResult:
    """What one group of a deal came to: its episodes (whole-episode groups) and the packed
    group, or why it was dropped."""

    seed: int
    episodes: list[Any]  # the Episodes of a whole-episode group; step groups have none
    group: ScoredDataGroup | None  # None when dropped
    dropped: DropReason | None = None


def prompt_length(masks: list[int]) -> int:
    for i, m in enumerate(masks):
        if m != MASKED:
            return i
    return len(masks)


def pack_group(sequences: list[Trajectory], scores: list[float], messages: list[list[dict[str, str]]],
               records: list[EpisodeRecord] | list[StepRecord], generation_params: dict[str, Any]) -> ScoredDataGroup:
    """An Atropos group; its sequences must open on the same prompt (GRPO's shared baseline)."""
    prompts = {tuple(t.tokens[: prompt_length(t.masks)]) for t in sequences}
    if len(prompts) > 1:
        raise ValueError("the sequences of one group must share their prompt; were they dealt from different seeds?")
    return ScoredDataGroup(
        tokens=[t.tokens for t in sequences],
        masks=[t.masks for t in sequences],
        inference_logprobs=[t.logprobs for t in sequences],
        scores=scores,
        messages=messages,
        generation_params=generation_params,
        episodes=records,
    )


def without_thoughts(messages: list[dict[str, str]], chat: ChatFormat) -> tuple[list[dict[str, str]], Trajectory]:
    """The history with earlier answers cut to their decisions (thoughts removed), as context.

    From here on the model sees a different history than the one its earlier answers
    were sampled in, so those answers become context: only answers sampled in exactly
    the final sequence's prefix stay trained. Every sequence then fits the budget and
    every trained token is on-policy for the tokens before it.
    """
    stripped = [
        {**m, "content": split_thinking(m["content"])[1]} if m["role"] == "assistant" else dict(m) for m in messages
    ]
    rebuilt = Trajectory()
    rebuilt.add_context(chat.prompt_ids(stripped[:2]))
    for m in stripped[2:]:
        if m["role"] == "assistant":
            rebuilt.add_context(chat.answer_ids(m["content"]))
        else:
            rebuilt.add_context(chat.next_turn_ids(m["content"]))
    return stripped, rebuilt
