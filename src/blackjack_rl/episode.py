"""One episode: table + policy + protocol -> an Episode record with its token trajectory.

Three ways an episode can end besides a game result, kept apart because they mean
different things: `invalid` (the model answered but not with a usable call: scored,
since that is what RL must fix), `truncated` (turn or token budget ran out: scored
like invalid), and `failed` (no answer could be obtained: never scored, never
counted as a game, always counted as a failure).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .game import Observation, Table
from .policies.base import InferenceError, Policy, Reply, Turn
from .protocol import ACTION_NAMES, ParsedAction, observation_text, parse_action, system_prompt
from .solver import Solution
from .tokens import ChatFormat, Trajectory

log = logging.getLogger(__name__)

Status = Literal["finished", "invalid", "truncated", "failed"]


@dataclass(frozen=True, slots=True)
class EpisodeSettings:
    invalid_score: float = -1.0
    max_turns: int = 10
    max_token_length: int = 1024
    max_new_tokens: int = 64
    thinking: bool = False


@dataclass(slots=True)
class Decision:
    """One model turn, scored against Q* (an expectation, never the seeded deck)."""

    player_sum: int
    dealer_card: int
    usable_ace: bool
    natural: bool
    action: int | None  # None: the answer was not a valid call
    optimal: int
    regret: float | None  # Q*(s, optimal) - Q*(s, action); None when invalid
    parse_error: str | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": [self.player_sum, self.dealer_card, int(self.usable_ace)],
            "natural": self.natural,
            "action": ACTION_NAMES.get(self.action) if self.action is not None else None,
            "optimal": ACTION_NAMES[self.optimal],
            "regret": self.regret,
            "parse_error": self.parse_error,
            "text": self.text,
        }


@dataclass
class Episode:
    seed: int
    index: int
    status: Status = "failed"
    outcome: Literal["win", "draw", "loss"] | None = None
    reward: float | None = None  # the game's reward, when the game finished
    score: float | None = None  # what training sees; None when failed
    invalid_reason: str | None = None
    error: str | None = None
    decisions: list[Decision] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    trajectory: Trajectory = field(default_factory=Trajectory)
    player_hand: list[int] = field(default_factory=list)
    dealer_hand: list[int] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def summary(self) -> dict[str, Any]:
        """Per-episode metadata that travels with a group and into samples.jsonl."""
        return {
            "seed": self.seed,
            "index": self.index,
            "status": self.status,
            "outcome": self.outcome,
            "reward": self.reward,
            "score": self.score,
            "invalid_reason": self.invalid_reason,
            "error": self.error,
            "actions": [ACTION_NAMES.get(d.action) if d.action is not None else None for d in self.decisions],
            "optimal_actions": [ACTION_NAMES[d.optimal] for d in self.decisions],
            "regret": sum(d.regret for d in self.decisions if d.regret is not None),
            "player_hand": self.player_hand,
            "dealer_hand": self.dealer_hand,
        }


def sampling_seed(deal_seed: int, index: int, turn: int) -> int:
    """A stable per-turn sampling seed, so reruns reproduce and episodes in a group differ."""
    return int(np.random.SeedSequence([deal_seed & 0xFFFFFFFFFFFF, index, turn]).generate_state(1)[0])


def opening_messages(observation: Observation, thinking: bool = False) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system_prompt(thinking=thinking)},
        {"role": "user", "content": observation_text(*observation)},
    ]


async def play_episode(
    table: Table,
    policy: Policy,
    chat: ChatFormat,
    solution: Solution,
    seed: int,
    index: int = 0,
    settings: EpisodeSettings = EpisodeSettings(),
    first_reply: Reply | None = None,
) -> Episode:
    """Play one deal. `first_reply`, when given, is the answer to the opening prompt,
    already sampled (a group can sample all its first answers in one request)."""
    ep = Episode(seed=seed, index=index)
    obs = table.reset(seed)
    ep.messages = opening_messages(obs, settings.thinking)
    ep.trajectory.add_context(chat.prompt_ids(ep.messages))

    for turn in range(settings.max_turns):
        if len(ep.trajectory) + settings.max_new_tokens > settings.max_token_length:
            return _cut(ep, table, "context_limit", settings)
        natural = table.player_is_natural
        try:
            if turn == 0 and first_reply is not None:
                reply = first_reply
            else:
                reply = await policy.respond(
                    Turn(ep.messages, ep.trajectory.tokens, obs, natural, sampling_seed(seed, index, turn))
                )
        except InferenceError as exc:
            return _fail(ep, table, str(exc))
        except Exception as exc:  # a broken policy fails the episode, not the whole run
            log.exception("policy %s raised while playing seed %s", getattr(policy, "name", policy), seed)
            return _fail(ep, table, f"{type(exc).__name__}: {exc}")

        ep.messages.append({"role": "assistant", "content": reply.text})
        if reply.completion_ids is not None:
            ep.trajectory.add_sampled(reply.completion_ids, reply.logprobs)
            if reply.finish_reason == "length":  # the model did not close its turn; the template does
                ep.trajectory.add_context(chat.end_of_turn_ids)
        else:
            ep.trajectory.add_sampled(chat.answer_ids(reply.text), None)

        parsed: ParsedAction = parse_action(reply.text, reply.tool_calls)
        q_best = solution.best_action(obs, natural)
        if not parsed.valid:
            ep.decisions.append(Decision(*obs, natural, None, q_best, None, parsed.error.value, reply.text))
            ep.status, ep.invalid_reason, ep.score = "invalid", parsed.error.value, settings.invalid_score
            return _finish_hands(ep, table)

        ep.decisions.append(
            Decision(*obs, natural, parsed.action, q_best, solution.regret(obs, parsed.action, natural), None, reply.text)
        )
        step = table.step(parsed.action)
        if step.terminated:
            ep.status, ep.reward, ep.score = "finished", step.reward, step.reward
            ep.outcome = "win" if step.reward > 0 else "loss" if step.reward < 0 else "draw"
            return _finish_hands(ep, table)
        obs = step.observation
        text = observation_text(*obs)
        ep.messages.append({"role": "user", "content": text})
        ep.trajectory.add_context(chat.next_turn_ids(text))

    return _cut(ep, table, "turn_limit", settings)


def _cut(ep: Episode, table: Table, reason: str, settings: EpisodeSettings) -> Episode:
    ep.status, ep.invalid_reason, ep.score = "truncated", reason, settings.invalid_score
    return _finish_hands(ep, table)


def _fail(ep: Episode, table: Table, error: str) -> Episode:
    ep.status, ep.error, ep.score = "failed", error, None
    return _finish_hands(ep, table)


def _finish_hands(ep: Episode, table: Table) -> Episode:
    ep.player_hand, ep.dealer_hand = table.player_hand, table.dealer_hand
    return ep
