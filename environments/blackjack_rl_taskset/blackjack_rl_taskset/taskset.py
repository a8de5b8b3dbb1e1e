"""blackjack-rl's hands as a verifiers 0.4 `Taskset`, played by an `Env` over one interaction.

A task is a deal seed; its prompt is `BlackjackEnv.reset(seed)`'s system and user turns.
The env's `run()` is the user of the conversation: each assistant message is one answer to
`BlackjackEnv.step` (its text, or its native tool calls), the next hand or a re-prompt's
feedback goes back as the next user turn, and the exchange ends with the hand. The one
reward is the episode's score as `BlackjackEnv` gives it, so the rules, the parser, the
turn limit and the scores are blackjack-rl's own; nothing of the game is written here.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules
from blackjack_rl.rollout.runner import EVAL_SEED_BASE

_REWARD = "episode_score"


class BlackjackTasksetConfig(vf.TasksetConfig):
    """`--env.taskset.*`: the rules, the deals and blackjack-rl's `EnvSettings`."""

    split: Literal["eval", "train"] = "eval"
    """`eval`: `evaluate`'s fixed deals, in its order. `train`: deals 0, 1, ... (disjoint from them)."""
    natural: bool = False
    sab: bool = False
    scoring: Literal["outcome", "expected"] = "outcome"
    format_bonus: float = 0.0
    invalid_retries: int = Field(0, ge=0)
    max_turns: int = Field(10, ge=1)
    invalid_score: float = -1.0
    thinking: bool = False

    def rules(self) -> Rules:
        return Rules(natural=self.natural, sab=self.sab)

    def settings(self) -> EnvSettings:
        return EnvSettings(
            invalid_score=self.invalid_score, max_turns=self.max_turns, thinking=self.thinking,
            scoring=self.scoring, format_bonus=self.format_bonus, invalid_retries=self.invalid_retries,
        )


class BlackjackData(vf.TaskData):
    info: dict
    """`{"seed": deal}`: the hand is reproducible from it alone."""


class BlackjackTask(vf.Task[BlackjackData]):
    pass


class BlackjackTaskset(vf.Taskset[BlackjackTask, BlackjackTasksetConfig]):
    """One task per deal; bound a run with `-n`."""

    INFINITE = True

    def seeds(self) -> Iterator[int]:
        if self.config.split == "eval":
            return (EVAL_SEED_BASE + i for i in count())
        return iter(range(EVAL_SEED_BASE))

    def load(self) -> Iterator[BlackjackTask]:
        env = BlackjackEnv(solution_for(self.config.rules()), self.config.settings())
        try:
            for seed in self.seeds():
                (system, user), _ = env.reset(seed)
                data = BlackjackData(name=f"deal#{seed}", system_prompt=system["content"],
                                     prompt=user["content"], info={"seed": seed})
                yield BlackjackTask(data, self.config.task)
        finally:
            env.close()


class BlackjackTableEnvConfig(vf.EnvConfig):
    """`--env.player.*`: the seat. Tool-less (`null` harness): the prompt teaches the
    `<tool_call>` text format, which our parser reads from the reply. The seat's chat
    program runs as a local subprocess, since it has no tools and nothing to isolate
    (verifiers' own default is a Prime sandbox, reached through a tunnel that needs a
    Prime login: `--env.player.runtime.type prime` restores it)."""

    player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime={"type": "subprocess"})


def _answer(segment: vf.Segment) -> tuple[str, list[dict[str, str]] | None]:
    """The segment's last assistant message as `BlackjackEnv.step` takes it: the raw text
    (not `last_reply`, which strips it) and any native tool calls."""
    for message in reversed(segment.messages):
        if isinstance(message, vf.AssistantMessage):
            calls = [{"name": c.name, "arguments": c.arguments} for c in message.tool_calls or []]
            return message.content or "", calls or None
    return "", None


def _record(trace: vf.Trace, env: BlackjackEnv) -> None:
    """The episode's score as the one reward; the game's facts for anyone replaying it. A
    failed episode (no answer could be obtained) gets no reward: verifiers keeps the
    rollout as errored, to be resumed, as our own runs never count it as a game."""
    play = env.play
    answers = len(play.decisions)
    if play.score is not None:
        trace.record_reward(_REWARD, float(play.score), 1.0)
    trace.record_metric("valid_answer_rate", sum(d.action is not None for d in play.decisions) / answers if answers else 0.0)
    trace.record_metric("retries", float(play.retries))
    trace.info["blackjack"] = {
        "seed": play.seed, "status": str(play.status), "outcome": str(play.outcome) if play.outcome else None,
        "score": play.score, "scores": dict(play.scores), "start_value": play.start_value,
        "invalid_reason": play.invalid_reason, "retries": play.retries,
        "actions": [d.action for d in play.decisions], "optimal": [d.optimal for d in play.decisions],
    }


class BlackjackTableEnv(vf.Env[BlackjackTableEnvConfig]):
    """Plays the task's hand through `BlackjackEnv`, the seat's replies as the answers."""

    async def run(self, task: BlackjackTask, agents: Any) -> None:
        config: BlackjackTasksetConfig = self.taskset.config
        env = BlackjackEnv(solution_for(config.rules()), config.settings())
        env.reset(int(task.data.info["seed"]))
        try:
            async with agents.player.interaction(task) as interaction:
                segment = await interaction.turn()  # the deal is the prompt: the seat answers first
                while not segment.terminated and not interaction.trace.errors:
                    observation, _, terminated, truncated, _ = env.step(*_answer(segment))
                    if terminated or truncated:
                        break
                    segment = await interaction.turn(observation)
                if not env.done:
                    if interaction.trace.errors:  # a model call failed: no answer, so no game
                        env.fail()
                    else:  # the rollout stopped first (a verifiers limit): scored like a truncation
                        env.truncate("rollout_ended")
                _record(interaction.trace, env)  # before the close, which finishes the rollout
        finally:
            env.close()
