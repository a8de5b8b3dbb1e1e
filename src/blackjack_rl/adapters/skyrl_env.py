"""SkyRL-gym: a `BaseTextEnv` registered as ``blackjack_rl`` (`skyrl_gym.make("blackjack_rl", extras=...)`).

SkyRL builds an env per dataset row: `extras` carries the row's fields. The deal seed is
`extras["seed"]` (or `extras["extra_info"]["seed"]`); rules and settings may ride in
`extras` too, or in `env_config`. `init(prompt)` returns this env's own opening messages
for that seed, so a dataset row needs no more than a seed (`dataset_rows` builds them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import register, registry

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules

ENV_ID = "blackjack_rl"
_SETTING_FIELDS = set(EnvSettings.__dataclass_fields__)
def _options(env_config: Any, extras: Mapping[str, Any]) -> dict[str, Any]:
    """Settings from the env config, overridden by the row's extras (and its `extra_info`)."""
    merged: dict[str, Any] = {}
    for source in (env_config, extras.get("extra_info"), extras):
        if isinstance(source, Mapping) or hasattr(source, "items"):
            merged.update({k: v for k, v in dict(source).items() if k in _SETTING_FIELDS | {"natural", "sab", "seed"}})
    return merged


class BlackjackSkyRLEnv(BaseTextEnv):
    """One hand per env instance, as SkyRL creates one env per trajectory."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        options = _options(env_config or {}, extras or {})
        if "seed" not in options:
            raise ValueError("blackjack_rl needs a deal seed: put `seed` in the dataset row (extras) or its extra_info")
        self.seed = int(options.pop("seed"))
        rules = Rules(natural=bool(options.pop("natural", False)), sab=bool(options.pop("sab", False)))
        self.env = BlackjackEnv(solution_for(rules), EnvSettings(**options))
        self.max_turns = self.env.settings.max_turns

    def init(self, prompt: Any = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return self.env.reset(self.seed)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        text, reward, terminated, truncated, info = self.env.step(action)
        done = terminated or truncated
        observations = [] if done else [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata=info)

    def get_metrics(self) -> dict[str, Any]:
        play = self.env.play
        return {
            "score": play.score if play.score is not None else 0.0,
            "valid_answers": sum(d.action is not None for d in play.decisions),
            "answers": len(play.decisions),
            "retries": play.retries,
            "win": float(play.outcome == "win"),
        }

    def close(self) -> None:
        self.env.close()


def dataset_rows(seeds: range | list[int], **options: Any) -> list[dict[str, Any]]:
    """SkyRL dataset rows for these deals: the opening prompt, the env class and the seed."""
    rules = Rules(natural=bool(options.get("natural", False)), sab=bool(options.get("sab", False)))
    settings = EnvSettings(**{k: v for k, v in options.items() if k in _SETTING_FIELDS})
    env = BlackjackEnv(solution_for(rules), settings)
    rows = []
    for seed in seeds:
        messages, _ = env.reset(seed)
        rows.append({"prompt": messages, "env_class": ENV_ID, "seed": int(seed), **options})
    env.close()
    return rows


def register_skyrl() -> None:
    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="blackjack_rl.adapters.skyrl_env:BlackjackSkyRLEnv")


register_skyrl()
