"""The table: Gymnasium's Blackjack-v1, seeded so that a deal can be replayed.

We keep Gymnasium's own implementation as the source of truth for the rules (the
solver is tested against it), and wrap it only to (a) reuse one env object per
worker, since `gym.make` costs ~0.4 ms, and (b) expose the two facts the
observation hides but scoring needs: whether a hand is a natural, and the final
hands for the episode record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import gymnasium as gym
from pydantic import BaseModel, ConfigDict


class Rules(BaseModel):
    """The rule variants of Blackjack-v1; `sab` (Sutton & Barto) overrides `natural`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    natural: bool = False
    sab: bool = False

    def describe(self) -> str:
        if self.sab:
            return "Blackjack-v1, Sutton & Barto rules (a natural beats any non-natural)"
        if self.natural:
            return "Blackjack-v1, natural pays 1.5"
        return "Blackjack-v1, default rules"


class Observation(NamedTuple):
    player_sum: int
    dealer_card: int  # 1 is an ace
    usable_ace: bool


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: Observation
    reward: float
    terminated: bool


def _hand_total(hand: list[int]) -> int:
    total = sum(hand)
    return total + 10 if 1 in hand and total + 10 <= 21 else total


class Table:
    """One reusable Blackjack-v1 env. `reset(seed)` fixes the deal and every later draw."""

    def __init__(self, rules: Rules | None = None) -> None:
        self.rules = rules or Rules()
        self._wrapped = gym.make("Blackjack-v1", natural=self.rules.natural, sab=self.rules.sab)
        # The unwrapped env skips the order/passive checkers on every step; we call
        # reset before step ourselves, so they only cost time.
        self._env = self._wrapped.unwrapped
        self._done = True

    def reset(self, seed: int) -> Observation:
        obs, _ = self._env.reset(seed=seed)
        self._done = False
        return Observation(int(obs[0]), int(obs[1]), bool(obs[2]))

    def step(self, action: int) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the hand ended: call reset(seed) to deal a new hand")
        obs, reward, terminated, truncated, _ = self._env.step(int(action))
        self._done = bool(terminated or truncated)
        return StepResult(Observation(int(obs[0]), int(obs[1]), bool(obs[2])), float(reward), self._done)

    @property
    def player_is_natural(self) -> bool:
        """A two-card 21: under `natural`/`sab` rules standing on it is worth more."""
        hand = self._env.player
        return len(hand) == 2 and _hand_total(hand) == 21

    @property
    def player_hand(self) -> list[int]:
        return list(self._env.player)

    @property
    def dealer_hand(self) -> list[int]:
        return list(self._env.dealer)

    def close(self) -> None:
        self._wrapped.close()
