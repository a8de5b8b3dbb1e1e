"""verifiers: a multi-turn environment (`vf.MultiTurnEnv`) that `load_environment(**kwargs)` returns.

Every assistant message is one answer to `BlackjackEnv.step`, parsed by our parser (text
or native tool calls); the env answers with the next hand, or a re-prompt's feedback, and
ends the rollout when the hand is over. The rubric's one reward is the episode's score,
so verifiers' reward equals `BlackjackEnv`'s for the same deal and the same answers.
The installable environment package (`vf-eval blackjack-rl-env`) is
``environments/blackjack_rl_env`` in the repository; it calls `load_environment` here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import verifiers as vf
from datasets import Dataset

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.rollout.runner import eval_seeds
from blackjack_rl.game.table import Rules

_STATE_KEY = "blackjack_env"
_SETTING_FIELDS = set(EnvSettings.__dataclass_fields__)


def _field(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, Mapping) else getattr(message, key, None)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(_field(part, "text") or "") for part in content)
    return ""


class BlackjackVerifiersEnv(vf.MultiTurnEnv):
    """One Blackjack hand per rollout; the deal seed is the row's `info["seed"]`."""

    def __init__(self, rules: Rules, settings: EnvSettings, seeds: list[int], eval_seed_list: list[int], **kwargs: Any):
        self.rules, self.settings = rules, settings
        self.solution = solution_for(rules)

        def rows(deals: list[int]) -> Dataset:
            env = BlackjackEnv(self.solution, settings)
            data = [{"prompt": env.reset(seed)[0], "answer": "", "info": {"seed": int(seed)}} for seed in deals]
            env.close()
            return Dataset.from_list(data)

        rubric = vf.Rubric(funcs=[self.episode_score], weights=[1.0])
        rubric.add_metric(self.valid_answer_rate)
        # verifiers' own turn limit would stop before the last answer is played: ours ends the rollout.
        super().__init__(dataset=rows(seeds), eval_dataset=rows(eval_seed_list), rubric=rubric, max_turns=-1, **kwargs)

    async def setup_state(self, state: vf.State) -> None:
        env = BlackjackEnv(self.solution, self.settings)
        env.reset(int(state["info"]["seed"]))
        state[_STATE_KEY] = env

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        env: BlackjackEnv = state[_STATE_KEY]
        answer = messages[-1]
        text, _, terminated, truncated, info = env.step(_text(_field(answer, "content")), _field(answer, "tool_calls"))
        state.setdefault("blackjack_steps", []).append(info)
        if terminated or truncated:
            play = env.play
            ending = f"The hand is over ({play.status}{': ' + play.outcome if play.outcome else ''})."
            state["final_env_response"] = [{"role": "user", "content": ending}]
            return state["final_env_response"]
        return [{"role": "user", "content": text}]

    async def episode_score(self, state: vf.State, **_: Any) -> float:
        """The episode's score. A rollout that stopped before the hand ended (a length or time
        limit) ends as truncated, scored like an invalid answer."""
        env: BlackjackEnv | None = state.get(_STATE_KEY)
        if env is None:
            return float(self.settings.invalid_score)
        if not env.done:
            env.truncate("rollout_ended")
        return float(env.play.score)

    async def valid_answer_rate(self, state: vf.State, **_: Any) -> float:
        env: BlackjackEnv | None = state.get(_STATE_KEY)
        decisions = env.play.decisions if env is not None else []
        return sum(d.action is not None for d in decisions) / len(decisions) if decisions else 0.0


def load_environment(
    natural: bool = False,
    sab: bool = False,
    num_train_deals: int = 10_000,
    num_eval_deals: int = 1_000,
    **kwargs: Any,
) -> BlackjackVerifiersEnv:
    """The verifiers environment. Keyword arguments: the rules (`natural`, `sab`), the deal
    counts, `EnvSettings` fields (`scoring`, `format_bonus`, `invalid_retries`, ...) and any
    `vf.MultiTurnEnv` option. Evaluation deals are `evaluate`'s fixed seeds; training deals
    are disjoint from them."""
    settings = EnvSettings(**{k: kwargs.pop(k) for k in list(kwargs) if k in _SETTING_FIELDS})
    if not (1 <= num_train_deals <= 10_000_000 and 1 <= num_eval_deals <= 10_000_000):
        raise ValueError("num_train_deals and num_eval_deals must be between 1 and 10,000,000")
    rules = Rules(natural=natural, sab=sab)
    return BlackjackVerifiersEnv(rules, settings, list(range(num_train_deals)), list(eval_seeds(num_eval_deals)), **kwargs)
