"""The wire models: pydantic Action / Observation / State on OpenEnv's base classes."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_ANSWER_CHARS = 20_000  # what the parser reads of an answer; a client cannot send more
MAX_TOOL_CALLS = 8


class BlackjackAction(Action):
    """The model's answer: its text, and the native tool calls when its server parsed them."""

    answer: str = Field("", max_length=MAX_ANSWER_CHARS, description="the model's whole answer")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, max_length=MAX_TOOL_CALLS, description="OpenAI-style tool calls, when the server parsed them"
    )


class BlackjackObservation(Observation):
    """The next messages to show the model (the whole prompt after reset), and what the env knows."""

    messages: list[dict[str, str]] = Field(default_factory=list, description="chat messages to append")
    info: dict[str, Any] = Field(default_factory=dict, description="parse result, state, Q*, optimal action, outcome")


class BlackjackState(State):
    seed: int | None = None
    status: str = "idle"
    score: float | None = None
