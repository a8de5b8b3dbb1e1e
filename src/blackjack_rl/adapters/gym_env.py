"""Gymnasium: `gymnasium.make("blackjack_rl/BlackjackText-v0", natural=..., sab=...)`, text in, text out.

The observation is the text of the next user turn (the hand, or a re-prompt's feedback);
the opening system prompt and the chat messages are in `info["messages"]` after `reset`,
so an agent can build the conversation a chat model needs. The action is the model's
whole answer, parsed exactly as everywhere else.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules
from blackjack_rl.game.solver import Solution

ENV_ID = "blackjack_rl/BlackjackText-v0"
ENTRY_POINT = "blackjack_rl.adapters.gym_env:BlackjackTextEnv"
CHARSET = string.printable  # letters, digits, punctuation and whitespace
MAX_OBSERVATION_CHARS = 1024
MAX_ANSWER_CHARS = 8192


def register_gymnasium() -> None:
    """Register the id once (importing twice, or with gymnasium already holding it, is harmless)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point=ENTRY_POINT)


def _printable(text: str) -> str:
    """Keep an observation inside the Text space: a re-prompt quotes the model's answer,
    which may hold characters outside the charset."""
    return "".join(c if c in CHARSET else "?" for c in text)[:MAX_OBSERVATION_CHARS]


class BlackjackTextEnv(gymnasium.Env):
    """One Blackjack-v1 hand per episode, played by writing `take_action` tool calls.

    Keyword options are `EnvSettings`' fields (scoring, format_bonus, invalid_retries, ...)
    plus the rules `natural` and `sab`. `reset(seed=s)` deals the same hand as every other
    entry point given `s`; without a seed, the deal seed comes from the env's own RNG.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        natural: bool = False,
        sab: bool = False,
        render_mode: str | None = None,
        solution: Solution | None = None,
        **settings: Any,
    ) -> None:
        rules = Rules(natural=natural, sab=sab)
        if solution is not None and solution.rules != rules:
            raise ValueError(f"solution is for {solution.rules}, not {rules}")
        self.env = BlackjackEnv(solution or solution_for(rules), EnvSettings(**settings))
        self.render_mode = render_mode
        self.observation_space = spaces.Text(max_length=MAX_OBSERVATION_CHARS, min_length=0, charset=CHARSET)
        self.action_space = spaces.Text(max_length=MAX_ANSWER_CHARS, min_length=0, charset=CHARSET)
        self._last = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        deal = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        messages, info = self.env.reset(deal)
        info["messages"] = messages
        self._last = _printable(messages[-1]["content"])
        return self._last, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        text, reward, terminated, truncated, info = self.env.step(action)
        self._last = _printable(text) if text is not None else ""
        return self._last, float(reward), terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last
        return None

    def close(self) -> None:
        self.env.close()
