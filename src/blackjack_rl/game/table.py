"""The table: Gymnasium's Blackjack-v1, seeded so that a deal can be replayed.

We keep Gymnasium's own implementation as the source of truth for the rules (the
solver is tested against it), and wrap it only to (a) reuse one env object per
worker, since `gym.make` costs ~0.4 ms, and (b) expose the two facts the
observation hides but scoring needs: whether a hand is a natural, and the final
hands for the episode record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict

# Gymnasium's action numbers
HIT = 1
STICK = 0


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
class TableStep:
    """What one action did to the table (the environment's `StepResult` adds the text and scores)."""

    observation: Observation
    reward: float
    terminated: bool


def _usable_ace(hand: list[int]) -> bool:
    return 1 in hand and sum(hand) + 10 <= 21


def _hand_total(hand: list[int]) -> int:
    total = sum(hand)
    return total + 10 if 1 in hand and total + 10 <= 21 else total


def hand_in_state(player_sum: int, usable_ace: bool, rng: random.Random) -> list[int]:
    """A player hand (cards 1-10, 1 an ace) with this total and usable ace, never a natural.

    Hard totals are two cards without an ace (three for 21), soft ones an ace and one card
    (an ace and two for 21); the split is drawn from `rng`.
    """
    if usable_ace:
        if not 12 <= player_sum <= 21:
            raise ValueError(f"a soft total is 12 to 21, got {player_sum}")
        if player_sum < 21:
            return [1, player_sum - 11]
        a = rng.randint(2, 8)
        return [1, a, 10 - a]
    if not 4 <= player_sum <= 21:
        raise ValueError(f"a hard total is 4 to 21, got {player_sum}")
    if player_sum == 21:
        a = rng.randint(2, 9)
        return [10, a, 11 - a]
    a = rng.randint(max(2, player_sum - 10), min(10, player_sum - 2))
    return [a, player_sum - a]


_DEALER_CARDS = 16  # the dealer's hole card and draws taken in one batch (he rarely needs 4); more are drawn if needed


class _Cards:
    """One role's stream for Gymnasium's `draw_card`, which asks `np_random.choice(deck)`: the
    next of `n` cards drawn at once from `rng`, then one at a time from the same `rng`."""

    __slots__ = ("rng", "deck", "cards", "next")

    def __init__(self, rng: Any, n: int) -> None:
        from gymnasium.envs.toy_text.blackjack import deck

        # `choice(deck, size=n)` is `deck[integers(0, len(deck), size=n)]`; the index array is
        # half its cost (tests/test_reward_only.py holds the cards to Gymnasium's own draws)
        self.rng, self.deck, self.next = rng, deck, 0
        self.cards = [deck[i] for i in rng.integers(0, len(deck), size=n).tolist()]

    def choice(self, _deck: object) -> int:
        if self.next == len(self.cards):
            self.cards.append(int(self.rng.choice(self.deck)))
        self.next += 1
        return self.cards[self.next - 1]


def _quick_action_check(space: Any) -> None:
    """Gymnasium's env checks every action with `Discrete.contains`, a few NumPy calls, and the
    rollouts of `hit_path` take hundreds of steps per decision: a plain int in range is answered
    at once, and anything else still gets Gymnasium's own check."""
    lo, hi, check = int(space.start), int(space.start) + int(space.n), type(space).contains
    space.contains = lambda x: (type(x) is int and lo <= x < hi) or check(space, x)


class Table:
    """One reusable Blackjack-v1 env. `reset(seed)` fixes the deal and every later draw."""

    def __init__(self, rules: Rules | None = None) -> None:
        import gymnasium as gym  # here, not at the top: `solve`, `--help` and the records need no table (~0.2 s)

        self.rules = rules or Rules()
        self._wrapped = gym.make("Blackjack-v1", natural=self.rules.natural, sab=self.rules.sab)
        # The unwrapped env skips the order/passive checkers on every step; we call
        # reset before step ourselves, so they only cost time.
        self._env = self._wrapped.unwrapped
        _quick_action_check(self._env.action_space)
        self._done = True
        self._streams: tuple[object, object] | None = None  # (player, dealer) generators after `resume`

    def reset(self, seed: int, start: Observation | None = None) -> Observation:
        """Deal `seed`; with `start`, the player's hand and the dealer's up card are replaced by a
        hand in that state (exploring starts), and every later card is still the seed's."""
        obs, _ = self._env.reset(seed=seed)
        self._done = False
        self._streams = None
        if start is not None:
            self._env.player = hand_in_state(start.player_sum, start.usable_ace, random.Random(seed))
            self._env.dealer[0] = int(start.dealer_card)
            return Observation(_hand_total(self._env.player), int(start.dealer_card), start.usable_ace)
        return Observation(int(obs[0]), int(obs[1]), bool(obs[2]))

    def resume(self, player_hand: list[int], dealer_card: int, seed: Sequence[int]) -> Observation:
        """Continue a hand from a decision with fresh hidden cards: the dealer's hole card and
        every later card are drawn anew from the key `seed`, the player's and the dealer's from two
        streams of their own.

        Gymnasium deals every card from one stream, so a replayed seed hands the dealer, after
        a stick, the card a hit would have given the player. With a stream per role, a hit and
        a stick resumed from the same seed see the same cards in the same roles: the common
        random numbers that make the difference of their rewards a low-variance estimate.
        The rewards are still Gymnasium's own. With an infinite deck, drawing the hidden cards
        given what the player has seen changes nothing.
        """
        import numpy as np  # Gymnasium's own dependency
        from gymnasium.envs.toy_text.blackjack import draw_card

        player_rng, dealer_rng = (np.random.default_rng([*seed, role]) for role in (0, 1))
        self._env.player = list(player_hand)
        self._env.dealer = [int(dealer_card), draw_card(dealer_rng)]
        self._streams = (player_rng, dealer_rng)
        self._done = False
        return Observation(_hand_total(self._env.player), int(dealer_card), _usable_ace(self._env.player))

    def hit_path(self, player_hand: list[int], dealer_card: int, seed: Sequence[int], max_hits: int
                 ) -> tuple[list[Observation], list[float], bool]:
        """Rollout `seed` of a hand from a decision, every action at once: the hands after 1, 2, ...
        hits (until one busts or `max_hits`), the stick's reward at the decision and after each
        of those hits, and whether the last hit busted.

        Each is what `resume(seed)`, that many hits and a stick give, and Gymnasium pays every
        reward, but on one pass: each role's cards are drawn in one call (a Generator's batch
        is the same sequence as its draws one by one), the dealer plays his hand once, since
        his cards do not depend on the player's, and a later stick meets his finished hand (17
        or more), so Gymnasium draws nothing and only scores it. Rollout credit plays hundreds of
        these per decision, so this is the reward-only trainer's inner loop.
        """
        import numpy as np  # Gymnasium's own dependency

        player_cards, dealer_cards = (_Cards(np.random.default_rng([*seed, role]), n)
                                      for role, n in ((0, max_hits), (1, _DEALER_CARDS)))
        env = self._env
        env.player, env.dealer = list(player_hand), [int(dealer_card), dealer_cards.choice(None)]
        env.np_random, self._streams, self._done = dealer_cards, None, True
        rewards = [float(env.step(STICK)[1])]  # Gymnasium plays the dealer out and pays
        dealer = env.dealer
        hand = list(player_hand)
        hands: list[Observation] = []
        env.np_random = player_cards
        for _ in range(max_hits):
            env.player, env.dealer = hand, list(dealer)
            obs, _, terminated, *_ = env.step(HIT)
            if terminated:
                return hands, rewards, True
            hands.append(Observation(int(obs[0]), int(obs[1]), bool(obs[2])))
            rewards.append(float(env.step(STICK)[1]))  # the finished dealer: scored, nothing drawn
            hand = env.player
        return hands, rewards, False

    def step(self, action: int) -> TableStep:
        if self._done:
            raise RuntimeError("step() after the hand ended: call reset(seed) to deal a new hand")
        if self._streams is not None:  # a resumed hand: the role that draws next uses its own stream
            self._env.np_random = self._streams[0] if action == HIT else self._streams[1]
        obs, reward, terminated, truncated, _ = self._env.step(int(action))
        self._done = bool(terminated or truncated)
        return TableStep(Observation(int(obs[0]), int(obs[1]), bool(obs[2])), float(reward), self._done)

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
