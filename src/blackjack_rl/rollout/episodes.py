"""One episode: table + policy + protocol -> an Episode record with its token trajectory.

Three ways an episode can end besides a game result, kept apart because they mean
different things: `invalid` (the model answered but not with a usable call: scored,
since that is what RL must fix), `truncated` (turn or token budget ran out: scored
like invalid), and `failed` (no answer could be obtained: never scored, never
counted as a game, always counted as a failure).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from blackjack_rl.contract.records import EpisodeRecord, SampleRow, Truncation
from blackjack_rl.contract.tokens import ChatFormat
from blackjack_rl.env import BlackjackEnv, Play, Status, episode_scores, opening_messages
from blackjack_rl.game.solver import Solution
from blackjack_rl.game.table import Table
from blackjack_rl.policies.base import InferenceError, Policy, Reply
from blackjack_rl.rollout.core import Conversation, EpisodeSettings, add_answer, without_thoughts

__all__ = [
    "Episode",
    "EpisodeSettings",
    "episode_scores",
    "opening_messages",
    "play_episode",
    "sampling_seed",
    "without_thoughts",
]

log = logging.getLogger(__name__)


@dataclass
class Episode(Play, Conversation):
    """A game (`Play`) as the model saw it (`Conversation`: messages, tokens), and its error."""

    status: Status = Status.FAILED
    index: int = 0
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == Status.FAILED

    def record(self) -> EpisodeRecord:
        """Per-episode metadata that travels with a group (and opens its samples.jsonl row)."""
        return EpisodeRecord(**self._record_fields())

    def sample_row(self) -> SampleRow:
        """The samples.jsonl row: the metadata, every decision, the messages."""
        return SampleRow(**self._record_fields(), decisions=list(self.decisions),
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
            actions=[d.action for d in self.decisions],
            optimal_actions=[d.optimal for d in self.decisions],
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
    messages, _ = env.reset(seed, record=ep)
    ep.open(messages, chat)
    while True:
        if not ep.make_room(settings, chat):
            env.truncate(Truncation.CONTEXT_LIMIT)
            return ep
        turn = env.turn
        try:
            if turn == 0 and first_reply is not None:
                reply = first_reply
            else:
                reply = await policy.respond(ep.turn(env, sampling_seed(seed, index, turn)))
        except InferenceError as exc:
            return _fail(ep, env, str(exc))
        except Exception as exc:  # a broken policy fails the episode, not the whole run
            log.exception("policy %s raised while playing seed %s", getattr(policy, "name", policy), seed)
            return _fail(ep, env, f"{type(exc).__name__}: {exc}")

        ep.messages.append({"role": "assistant", "content": reply.text})
        add_answer(ep.trajectory, reply, chat)
        text, _, terminated, truncated, _ = env.step(reply.text, reply.tool_calls)
        if text is not None:
            ep.add_user(text, chat)
        if terminated or truncated:
            return ep


def _fail(ep: Episode, env: BlackjackEnv, error: str) -> Episode:
    env.fail()
    ep.error = error
    return ep
