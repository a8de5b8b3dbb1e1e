"""Settings -> a Player: the policy from `make_policy`, the episode rules from the config.

Every command that plays (process, evaluate, serve, train, the cluster's shards and workers)
builds its player here, so they all play the same thing for the same settings.
"""

from __future__ import annotations

from .config import Settings
from .episode import EpisodeSettings
from .groups import Player
from .policies import make_policy, sampling_of
from .solver import solve


def build_player(settings: Settings) -> Player:
    built = make_policy(settings)
    e = settings.episode
    episode = EpisodeSettings(
        invalid_score=e.invalid_score,
        max_turns=settings.game.max_turns,
        max_token_length=e.max_token_length,
        max_new_tokens=sampling_of(settings).max_tokens,
        thinking=e.thinking,
        scoring=e.scoring,
        format_bonus=e.format_bonus,
        invalid_retries=e.invalid_retries,
    )
    return Player(built.policy, built.chat, solve(settings.game.rules), episode)
