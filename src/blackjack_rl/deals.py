"""The groups one deal yields, whichever way groups are made: the one entry point that jobs
(process, serve, the trainer, Ray shards) call, above both kinds of group (no import cycle)."""

from __future__ import annotations

import asyncio

from .groups import GroupResult, Player, play_group
from .stepgroups import play_step_groups


async def play_deal(player: Player, seed: int, config, limiter: asyncio.Semaphore | None = None) -> list[GroupResult]:
    """The groups one deal yields: one whole-episode group, or one group per decision.

    `config` is a GroupConfig (group_size, group_by, continue_with, drop_equal_scores).
    """
    if config.group_by == "step":
        deal = await play_step_groups(player, seed, config.group_size, continue_with=config.continue_with,
                                      drop_equal_scores=config.drop_equal_scores, limiter=limiter,
                                      counterfactual=config.counterfactual,
                                      token_advantages=config.token_advantages,
                                      scale_decisions=config.scale_decisions, format_weight=config.format_weight,
                                      starts=config.starts, first_only=config.decisions == "first")
        return deal.groups
    if config.counterfactual:
        raise ValueError("counterfactual groups are step groups: use --group-by step with --counterfactual")
    return [await play_group(player, seed, config.group_size, drop_equal_scores=config.drop_equal_scores,
                             limiter=limiter, token_advantages=config.token_advantages,
                             scale_decisions=config.scale_decisions, format_weight=config.format_weight)]
