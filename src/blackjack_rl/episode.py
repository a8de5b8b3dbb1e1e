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
from typing import Any

import numpy as np

from .env import BlackjackEnv, Decision, EnvSettings, Play, Status, episode_scores, opening_messages
from .game import Table
from .policies.base import InferenceError, Policy, Reply, Turn
from .protocol import ACTION_NAMES, split_thinking
from .records import EpisodeRecord, SampleRow, Truncation
from .solver import Solution
from .tokens import ChatFormat, Trajectory

__all__ = [
    "Decision",
    "Episode",
    "EpisodeSettings",
    "episode_scores",
    "opening_messages",
    "play_episode",
    "sampling_seed",
    "without_thoughts",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EpisodeSettings(EnvSettings):
    """The game's settings plus the token budget, which only a player that tokenizes can keep."""

    max_token_length: int = 1024
    max_new_tokens: int = 64


@dataclass
class Episode(Play):
    """A game (`Play`) with what playing it through a policy adds: messages, tokens, errors."""

    status: Status = Status.FAILED
    index: int = 0
    thoughts_truncated: int = 0  # model turns whose earlier thoughts were cut to fit the budget
    error: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    trajectory: Trajectory = field(default_factory=Trajectory)

    @property
    def failed(self) -> bool:
        return self.status == Status.FAILED

    def record(self) -> EpisodeRecord:
        """Per-episode metadata that travels with a group (and opens its samples.jsonl row)."""
        return EpisodeRecord(**self._record_fields())

    def sample_row(self) -> SampleRow:
        """The samples.jsonl row: the metadata, every decision, the messages."""
        return SampleRow(**self._record_fields(), decisions=[d.record() for d in self.decisions],
                         messages=self.messages)

    def _record_fields(self) -> dict[str, Any]:
        return dict(
            seed=self.seed,
            index=self.index,
            status=self.status,
            outcome=self.outcome,
            reward=self.reward,
            score=self.score,
            scores=self.scores,
            start_value=self.start_value,
            invalid_reason=self.invalid_reason,
            retries=self.retries,
            error=self.error,
            actions=[ACTION_NAMES.get(d.action) if d.action is not None else None for d in self.decisions],
            optimal_actions=[ACTION_NAMES[d.optimal] for d in self.decisions],
            regret=sum(d.regret for d in self.decisions if d.regret is not None),
            player_hand=self.player_hand,
            dealer_hand=self.dealer_hand,
        )


def sampling_seed(deal_seed: int, index: int, turn: int) -> int:
    """A stable per-turn sampling seed, so reruns reproduce and episodes in a group differ."""
    return int(np.random.SeedSequence([deal_seed & 0xFFFFFFFFFFFF, index, turn]).generate_state(1)[0])


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
    """Play one deal through `BlackjackEnv`, adding the tokens the trainer needs.

    `first_reply`, when given, is the answer to the opening prompt, already sampled (a
    group can sample all its first answers in one request).
    """
    env = BlackjackEnv(solution, settings, table)
    ep = Episode(seed=seed, index=index)
    ep.messages, _ = env.reset(seed, record=ep)
    ep.trajectory.add_context(chat.prompt_ids(ep.messages))

    while True:
        if len(ep.trajectory) + settings.max_new_tokens > settings.max_token_length and settings.thinking:
            _drop_old_thoughts(ep, chat)
        if len(ep.trajectory) + settings.max_new_tokens > settings.max_token_length:
            env.truncate(Truncation.CONTEXT_LIMIT)
            return ep
        turn = env.turn
        try:
            if turn == 0 and first_reply is not None:
                reply = first_reply
            else:
                reply = await policy.respond(
                    Turn(ep.messages, ep.trajectory.tokens, env.observation, env.natural,
                         sampling_seed(seed, index, turn))
                )
        except InferenceError as exc:
            return _fail(ep, env, str(exc))
        except Exception as exc:  # a broken policy fails the episode, not the whole run
            log.exception("policy %s raised while playing seed %s", getattr(policy, "name", policy), seed)
            return _fail(ep, env, f"{type(exc).__name__}: {exc}")

        ep.messages.append({"role": "assistant", "content": reply.text})
        if reply.completion_ids is not None:
            ep.trajectory.add_sampled(reply.completion_ids, reply.logprobs)
            if reply.finish_reason == "length":  # the model did not close its turn; the template does
                ep.trajectory.add_context(chat.end_of_turn_ids)
        else:
            ep.trajectory.add_sampled(chat.answer_ids(reply.text), None)

        text, _, terminated, truncated, _ = env.step(reply.text, reply.tool_calls)
        if text is not None:
            ep.messages.append({"role": "user", "content": text})
            ep.trajectory.add_context(chat.next_turn_ids(text))
        if terminated or truncated:
            return ep


def _fail(ep: Episode, env: BlackjackEnv, error: str) -> Episode:
    env.fail()
    ep.error = error
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
