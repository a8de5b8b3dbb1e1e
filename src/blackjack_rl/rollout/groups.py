"""A group of episodes on one deal -> an Atropos `ScoredDataGroup`.

Every episode of a group starts from the same seed, hence the same cards and the
byte-identical prompt that GRPO's group baseline (and trainers that take the shared
prefix as the prompt) rely on; only the model's sampling differs.
"""

from __future__ import annotations

import asyncio

from blackjack_rl.config import GroupConfig
from blackjack_rl.contract.records import DropReason, Status
from blackjack_rl.rollout.core import GroupResult, limited, pack_group
from blackjack_rl.rollout.credit import AnswerAdvantage, AnswerCredit, decision_advantages, token_advantages, validity_advantages
from blackjack_rl.rollout.episodes import Episode
from blackjack_rl.rollout.players import Player


async def play_group(player: Player, seed: int, config: GroupConfig,
                     limiter: asyncio.Semaphore | None = None) -> GroupResult:
    firsts = await player.first_replies(seed, config.group_size)
    episodes = list(await asyncio.gather(*(
        limited(limiter, lambda i=i: player.episode(seed, i, firsts[i])) for i in range(config.group_size)
    )))
    if any(ep.failed for ep in episodes):
        # A group with a hole would change GRPO's baseline and the group size the API
        # expects; the failures stay visible in the counts instead.
        return GroupResult(seed, episodes, None, DropReason.FAILED_EPISODES)
    scores = [float(ep.score) for ep in episodes]
    if config.drop_equal_scores and len(episodes) > 1 and len(set(scores)) == 1:
        return GroupResult(seed, episodes, None, DropReason.EQUAL_SCORES)
    group = pack_group([ep.trajectory for ep in episodes], scores, [ep.messages for ep in episodes],
                       [ep.record() for ep in episodes], player.policy.generation_params())
    if config.token_advantages:
        group.advantages = episode_advantages(episodes, player, config.scale_decisions, config.format_weight)
    return GroupResult(seed, episodes, group)


def episode_advantages(episodes: list[Episode], player: Player, scale_decisions: bool = False,
                       format_weight: float = 1.0) -> list[list[float]]:
    """Per-token advantages of whole episodes (credit.py): each answer's format tokens carry
    the episode's validity credit against its group, each decision's action tokens that
    decision's Q* against the mean of both actions."""
    settings, solution = player.settings, player.solution
    credits = [AnswerCredit(ep.status == Status.FINISHED, None) for ep in episodes]
    formats = validity_advantages(credits, settings.invalid_score, settings.format_bonus, format_weight)
    answers = []
    for ep in episodes:
        row = []
        for d in ep.decisions:
            decision = 0.0
            if d.action is not None:
                q = solution.q_values(d.observation, d.natural)
                decision = decision_advantages([AnswerCredit(True, d.action_id)], q, None, scale_decisions)[0]
            row.append(AnswerAdvantage(d.text, d.action is not None, decision))
        answers.append(row)
    return token_advantages([ep.trajectory for ep in episodes], answers, formats, player.chat.backend.decode)
