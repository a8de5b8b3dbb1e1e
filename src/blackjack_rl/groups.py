"""A group of episodes on one deal -> an Atropos `ScoredDataGroup`.

Every episode of a group starts from the same seed, hence the same cards and the
byte-identical prompt that GRPO's group baseline (and trainers that take the shared
prefix as the prompt) rely on; only the model's sampling differs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .episode import Episode, EpisodeSettings, opening_messages, play_episode, sampling_seed
from .game import Rules, Table
from .policies.base import Policy, Reply, Turn, answers_at_once
from .credit import (
    AnswerCredit,
    action_char_span,
    action_token_indices,
    answer_token_advantages,
    decision_advantages,
    spread,
    validity_advantages,
)
from .records import DropReason, ScoredDataGroup, Status
from .solver import Solution
from .tokens import MASKED, ChatFormat, trained_spans


class TablePool:
    """Gymnasium envs reused across episodes: one per episode in flight, never one per episode."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self._free: list[Table] = []

    def acquire(self) -> Table:
        return self._free.pop() if self._free else Table(self.rules)

    def release(self, table: Table) -> None:
        self._free.append(table)


@dataclass
class Player:
    """What it takes to play episodes: the policy, its tokenizer's chat format, the solved rules."""

    policy: Policy
    chat: ChatFormat
    solution: Solution
    settings: EpisodeSettings = field(default_factory=EpisodeSettings)
    tables: TablePool = field(init=False)

    def __post_init__(self) -> None:
        self.tables = TablePool(self.solution.rules)

    async def episode(self, seed: int, index: int = 0, first_reply: Reply | None = None) -> Episode:
        table = self.tables.acquire()
        try:
            return await play_episode(
                table, self.policy, self.chat, self.solution, seed, index, self.settings, first_reply
            )
        finally:
            self.tables.release(table)

    async def first_replies(self, seed: int, n: int) -> list[Reply] | list[None]:
        """All first answers of a group in one request, when the policy can (`respond_many`).

        Every episode of a group opens on the same prompt, so a server that honours
        `n` prefills it once. A failure here is not fatal: episodes then ask one by one.
        """
        if getattr(self.policy, "respond_many", None) is None or n < 2:
            return [None] * n  # without dealing the table
        table = self.tables.acquire()
        try:
            obs = table.reset(seed)
            natural = table.player_is_natural
        finally:
            self.tables.release(table)
        messages = opening_messages(obs, self.settings.thinking)
        turn = Turn(messages, self.chat.prompt_ids(messages), obs, natural, sampling_seed(seed, 0, 0))
        replies = await answers_at_once(self.policy, turn, n)
        return replies if replies is not None else [None] * n


@dataclass
class GroupResult:
    seed: int
    episodes: list[Episode]
    group: ScoredDataGroup | None  # None when dropped
    dropped: DropReason | None = None


async def play_group(
    player: Player,
    seed: int,
    group_size: int,
    *,
    drop_equal_scores: bool = False,
    limiter: asyncio.Semaphore | None = None,
    token_advantages: bool = False,
    scale_decisions: bool = False,
    format_weight: float = 1.0,
) -> GroupResult:
    firsts = await player.first_replies(seed, group_size)

    async def one(i: int) -> Episode:
        if limiter is None:
            return await player.episode(seed, i, firsts[i])
        async with limiter:  # taken once per episode: no nested acquisition, no deadlock
            return await player.episode(seed, i, firsts[i])

    episodes = list(await asyncio.gather(*(one(i) for i in range(group_size))))
    if any(ep.failed for ep in episodes):
        # A group with a hole would change GRPO's baseline and the group size the API
        # expects; the failures stay visible in the counts instead.
        return GroupResult(seed, episodes, None, DropReason.FAILED_EPISODES)
    scores = [ep.score for ep in episodes]
    if drop_equal_scores and len(episodes) > 1 and len(set(scores)) == 1:
        return GroupResult(seed, episodes, None, DropReason.EQUAL_SCORES)
    group = pack_group(episodes, player.policy.generation_params())
    if token_advantages:
        group.advantages = episode_advantages(episodes, player, scale_decisions, format_weight)
    return GroupResult(seed, episodes, group)


def episode_advantages(episodes: list[Episode], player: Player, scale_decisions: bool = False,
                       format_weight: float = 1.0) -> list[list[float]]:
    """Per-token advantages of whole episodes (credit.py): each answer's format tokens carry
    the episode's validity credit against its group, each decision's action tokens that
    decision's Q* against the mean of both actions."""
    settings, solution, decode = player.settings, player.solution, player.chat.backend.decode
    credits = [AnswerCredit(ep.status == Status.FINISHED, None) for ep in episodes]
    fmt = validity_advantages(credits, settings.invalid_score, settings.format_bonus, format_weight)
    rows = []
    for ep, f in zip(episodes, fmt):
        masks = ep.trajectory.masks
        answers = [
            [ep.trajectory.tokens[i] for i in range(a, b)] for a, b in trained_spans(masks)
        ]
        per_answer = []
        for ids, d in zip(answers, ep.decisions):
            if d.action is None:
                per_answer.append([f] * len(ids))
                continue
            q = solution.q_values((d.player_sum, d.dealer_card, d.usable_ace), d.natural)
            dec = decision_advantages([AnswerCredit(True, d.action)], q, None, scale_decisions)[0]
            action = action_token_indices(ids, action_char_span(d.text), decode)
            per_answer.append(answer_token_advantages(len(ids), action, f, dec))
        rows.append(spread(masks, MASKED, per_answer))
    return rows


def pack_group(episodes: list[Episode], generation_params: dict[str, Any]) -> ScoredDataGroup:
    prompts = {tuple(ep.trajectory.tokens[: _prompt_length(ep)]) for ep in episodes}
    if len(prompts) > 1:
        raise ValueError("episodes of one group must share their prompt; were they dealt from different seeds?")
    return ScoredDataGroup(
        tokens=[ep.trajectory.tokens for ep in episodes],
        masks=[ep.trajectory.masks for ep in episodes],
        inference_logprobs=[ep.trajectory.logprobs for ep in episodes],
        scores=[float(ep.score) for ep in episodes],
        messages=[ep.messages for ep in episodes],
        generation_params=generation_params,
        episodes=[ep.record() for ep in episodes],
    )


def _prompt_length(ep: Episode) -> int:
    masks = ep.trajectory.masks
    for i, m in enumerate(masks):
        if m != MASKED:
            return i
    return len(masks)
