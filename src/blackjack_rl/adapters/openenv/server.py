"""The server side: `BlackjackEnv` as an OpenEnv `Environment`, one instance per session."""

from __future__ import annotations

import secrets
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules
from blackjack_rl.adapters.openenv.models import BlackjackAction, BlackjackObservation, BlackjackState

ENV_NAME = "blackjack_rl"


class BlackjackEnvironment(Environment[BlackjackAction, BlackjackObservation, BlackjackState]):
    """Sessions share nothing but the (immutable) solution, so concurrent sessions are isolated."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, rules: Rules | None = None, settings: EnvSettings | None = None) -> None:
        super().__init__()
        self.env = BlackjackEnv(solution_for(rules or Rules()), settings or EnvSettings())
        self._state = BlackjackState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> BlackjackObservation:
        # No seed: a fresh random deal (a seed is what makes a deal reproducible).
        deal = int(seed) if seed is not None else secrets.randbelow(2**31)
        messages, info = self.env.reset(deal)
        self._state = BlackjackState(episode_id=episode_id or str(uuid4()), step_count=0, seed=deal, status="playing")
        return BlackjackObservation(messages=messages, info=info, done=False, reward=0.0)

    def step(self, action: BlackjackAction, timeout_s: float | None = None, **kwargs: Any) -> BlackjackObservation:
        if self.env.done or self._state.seed is None:
            return BlackjackObservation(done=True, reward=0.0, info={"error": "the episode is over: reset to deal again"})
        text, reward, terminated, truncated, info = self.env.step(action.answer, action.tool_calls)
        self._state.step_count += 1
        self._state.status = self.env.play.status
        self._state.score = self.env.play.score
        messages = [] if text is None else [{"role": "user", "content": text}]
        return BlackjackObservation(messages=messages, info=info, done=terminated or truncated, reward=reward)

    @property
    def state(self) -> BlackjackState:
        return self._state

    def close(self) -> None:
        self.env.close()


def create_openenv_app(rules: Rules | None = None, settings: EnvSettings | None = None, max_concurrent_envs: int = 64):
    """The FastAPI app: /reset, /step, /state, /schema, /health and the /ws sessions."""
    return create_app(
        lambda: BlackjackEnvironment(rules, settings),
        BlackjackAction,
        BlackjackObservation,
        env_name=ENV_NAME,
        max_concurrent_envs=max_concurrent_envs,
    )
