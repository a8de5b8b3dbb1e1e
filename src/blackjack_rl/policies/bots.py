"""Scripted players: baselines for reports and exact, fast policies for tests and benchmarks.

They answer in the same tool-call text an LLM must produce, so they exercise the
whole pipeline (parsing, tokenization, packing) exactly like a model does.
"""

from __future__ import annotations

import random
from typing import Any

from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.game.solver import Solution
from blackjack_rl.policies.base import Reply, Turn


class _Bot:
    name = "bot"

    def choose(self, turn: Turn) -> int:
        raise NotImplementedError

    def generation_params(self) -> dict[str, Any]:
        return {"policy": self.name}

    async def respond(self, turn: Turn) -> Reply:
        return Reply(text=tool_call_text(self.choose(turn)))

    async def aclose(self) -> None:
        return None


class OptimalBot(_Bot):
    """Plays Q*-greedy: the exact optimal policy for the rules it was solved for."""

    name = "optimal"

    def __init__(self, solution: Solution) -> None:
        self.solution = solution

    def choose(self, turn: Turn) -> int:
        return self.solution.best_action(turn.observation, turn.natural)

    def hit_probability(self, observation, natural: bool) -> float:
        return float(self.solution.best_action(observation, natural) == HIT)


class ThresholdBot(_Bot):
    """Hits below a fixed sum, the classic naive strategy (17 mimics the dealer)."""

    def __init__(self, threshold: int = 17) -> None:
        if not 2 <= threshold <= 22:
            raise ValueError(f"threshold must be between 2 and 22, got {threshold}")
        self.threshold = threshold
        self.name = f"threshold-{threshold}"

    def choose(self, turn: Turn) -> int:
        return HIT if turn.observation.player_sum < self.threshold else STICK

    def hit_probability(self, observation, natural: bool) -> float:
        return float(observation[0] < self.threshold)


class RandomBot(_Bot):
    """Hits with probability `p_hit`; seeded per turn so a dataset is reproducible."""

    def __init__(self, p_hit: float = 0.5) -> None:
        self.p_hit = p_hit
        self.name = "random"

    def choose(self, turn: Turn) -> int:
        return HIT if random.Random(turn.seed).random() < self.p_hit else STICK

    def hit_probability(self, observation, natural: bool) -> float:
        return self.p_hit
