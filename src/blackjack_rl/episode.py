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
from .protocol import ACTION_NAMES, ParsedAction, observation_text, parse_action, split_thinking, system_prompt
from .solver import Solution
from .tokens import ChatFormat, Trajectory

log = logging.getLogger(__name__)

Status = Literal["finished", "invalid", "truncated", "failed"]


Scoring = Literal["outcome", "expected"]


@dataclass(frozen=True, slots=True)
class EpisodeSettings:
    invalid_score: float = -1.0
    max_turns: int = 10
    max_token_length: int = 1024
    max_new_tokens: int = 64
    thinking: bool = False
    scoring: Scoring = "outcome"
    format_bonus: float = 0.0  # added in proportion to the share of well-formed answers


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
    score: float | None = None  # what training sees (the chosen scoring mode); None when failed
    scores: dict[str, float] = field(default_factory=dict)  # every scoring mode, always reported
    start_value: float | None = None  # V*(first state): what optimal play expects from this deal
    thoughts_truncated: int = 0  # model turns whose earlier thoughts were cut to fit the budget
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
            "scores": self.scores,
            "start_value": self.start_value,
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
    ep.start_value = solution.v(obs, table.player_is_natural)
    ep.messages = opening_messages(obs, settings.thinking)
    ep.trajectory.add_context(chat.prompt_ids(ep.messages))

    for turn in range(settings.max_turns):
        if len(ep.trajectory) + settings.max_new_tokens > settings.max_token_length and settings.thinking:
            _drop_old_thoughts(ep, chat)
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
            ep.status, ep.invalid_reason = "invalid", parsed.error.value
            return _finish(ep, table, settings)

        ep.decisions.append(
            Decision(*obs, natural, parsed.action, q_best, solution.regret(obs, parsed.action, natural), None, reply.text)
        )
        step = table.step(parsed.action)
        if step.terminated:
            ep.status, ep.reward = "finished", step.reward
            ep.outcome = "win" if step.reward > 0 else "loss" if step.reward < 0 else "draw"
            return _finish(ep, table, settings)
        obs = step.observation
        text = observation_text(*obs)
        ep.messages.append({"role": "user", "content": text})
        ep.trajectory.add_context(chat.next_turn_ids(text))

    return _cut(ep, table, "turn_limit", settings)


def episode_scores(ep: Episode, settings: EpisodeSettings) -> dict[str, float]:
    """Both scoring modes for a played episode.

    `outcome` is the game's reward, as the original. `expected` is what the decisions
    were worth: V*(s0) minus the regret of every decision, i.e. V*(s0) plus
    sum(Q*(s, a) - V*(s)). Both are expectations-consistent (for any policy their means
    over deals are equal), but `expected` does not pay for the luck of the cards, so its
    variance is far lower; it never looks at the seeded deck.
    """
    answers = len(ep.decisions)
    bonus = settings.format_bonus * (sum(d.action is not None for d in ep.decisions) / answers) if answers else 0.0
    if ep.status != "finished":
        return {"outcome": settings.invalid_score + bonus, "expected": settings.invalid_score + bonus}
    regret = sum(d.regret for d in ep.decisions if d.regret is not None)
    return {"outcome": float(ep.reward) + bonus, "expected": float(ep.start_value) - regret + bonus}


def _finish(ep: Episode, table: Table, settings: EpisodeSettings) -> Episode:
    ep.scores = episode_scores(ep, settings)
    ep.score = ep.scores[settings.scoring]
    return _finish_hands(ep, table)


def _cut(ep: Episode, table: Table, reason: str, settings: EpisodeSettings) -> Episode:
    ep.status, ep.invalid_reason = "truncated", reason
    return _finish(ep, table, settings)


def _fail(ep: Episode, table: Table, error: str) -> Episode:
    ep.status, ep.error, ep.score = "failed", error, None
    return _finish_hands(ep, table)


def _finish_hands(ep: Episode, table: Table) -> Episode:
    ep.player_hand, ep.dealer_hand = table.player_hand, table.dealer_hand
    return ep


def _drop_old_thoughts(ep: Episode, chat: ChatFormat) -> None:
    ep.messages, ep.trajectory = without_thoughts(ep.messages, chat)
    ep.thoughts_truncated += 1


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
