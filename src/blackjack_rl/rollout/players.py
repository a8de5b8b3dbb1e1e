"""A Player: what it takes to play episodes (policy, chat format, solved rules, episode settings).

Every command that plays (process, evaluate, serve, train, the cluster's shards and workers)
builds its player with `build_player`, so they all play the same thing for the same settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from blackjack_rl.config import Settings
from blackjack_rl.contract.tokens import ChatFormat
from blackjack_rl.env import opening_messages
from blackjack_rl.game.solver import Solution, solve
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.outputs import prepare_folder
from blackjack_rl.policies import make_policy, sampling_of
from blackjack_rl.policies.base import AnswersMany, Policy, Reply, Turn, answers_at_once
from blackjack_rl.rollout.core import EpisodeSettings
from blackjack_rl.rollout.episodes import Episode, play_episode, sampling_seed

T = TypeVar("T")


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
        """All first answers of a group in one request, when the policy can (`AnswersMany`).

        Every episode of a group opens on the same prompt, so a server that honours
        `n` prefills it once. A failure here is not fatal: episodes then ask one by one.
        """
        if not isinstance(self.policy, AnswersMany) or n < 2:
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


def episode_settings(settings: Settings) -> EpisodeSettings:
    e = settings.episode
    return EpisodeSettings(
        invalid_score=e.invalid_score,
        max_turns=settings.game.max_turns,
        max_token_length=e.max_token_length,
        max_new_tokens=sampling_of(settings).max_tokens,
        thinking=e.thinking,
        scoring=e.scoring,
        format_bonus=e.format_bonus,
        invalid_retries=e.invalid_retries,
    )


def build_player(settings: Settings) -> Player:
    built = make_policy(settings)
    return Player(built.policy, built.chat, solve(settings.game.rules), episode_settings(settings))


def run_with_player(settings: Settings, job: Callable[[Player], Awaitable[T]]) -> T:
    """Build the player the settings describe, run `job(player)` to its end, and always close the
    policy (a llama.cpp model or a server pool holds threads and sockets). The output folder is
    proved writable first: a model loads in seconds, and a chart or a training run takes minutes."""
    prepare_folder(settings.out)
    player = build_player(settings)

    async def main() -> T:
        try:
            return await job(player)
        finally:
            await player.policy.aclose()

    return asyncio.run(main())
