"""The client side: OpenEnv's `EnvClient` typed with our models (async; `.sync()` for blocking use)."""

from __future__ import annotations

from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult

from blackjack_rl.adapters.openenv.models import BlackjackAction, BlackjackObservation, BlackjackState


class BlackjackOpenEnvClient(EnvClient[BlackjackAction, BlackjackObservation, BlackjackState]):
    def _step_payload(self, action: BlackjackAction) -> dict[str, Any]:
        return action.model_dump(exclude={"metadata"}, exclude_none=True)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[BlackjackObservation]:
        observation = BlackjackObservation(
            **payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward")
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> BlackjackState:
        return BlackjackState(**payload)
