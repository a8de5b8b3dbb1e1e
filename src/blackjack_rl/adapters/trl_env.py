"""TRL (>= 1.16): an `environment_factory` class for `GRPOTrainer`, and the prompt dataset it trains on.

    trainer = GRPOTrainer(model=..., processing_class=tool_chat_tokenizer(tok),
                          train_dataset=prompt_dataset(range(1000)),   # optional
                          environment_factory=BlackjackTRLEnv, args=GRPOConfig(...))

TRL keeps a pool of instances and calls `reset(**row)` on one per rollout, batch after batch;
`reset` starts a fresh hand, so nothing of an earlier rollout is left. The public method
`take_action` becomes the model's tool (its docstring is the schema), and `get_reward()` is
TRL's reward for the rollout: the episode's score from `BlackjackEnv`. Each call TRL runs is
one answer to `BlackjackEnv.step`; the rollout ends with a message TRL found no call in, and
when the hand is not over by then, that message is an answer without a call (invalid, as in
our own loop) and the episode ends there without a re-prompt.

Without a dataset, `reset()` deals the next seed of its factory (from `first_seed` up, each
seed `group_size` times in a row) and returns the prompt for TRL to show.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, ClassVar

from blackjack_rl.contract.protocol import TOOL_NAME
from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules


class GameOver(RuntimeError):
    """Raised by `take_action` after the hand ended; TRL shows the message to the model."""


class BlackjackTRLEnv:
    """One Blackjack hand per rollout; `trl_environment(...)` makes one with other rules or scoring.

    TRL makes every public method but `reset` and `get_reward` a tool, so this class has exactly
    one: `take_action`.
    """

    rules: ClassVar[Rules] = Rules()
    settings: ClassVar[EnvSettings] = EnvSettings()
    first_seed: ClassVar[int] = 0
    group_size: ClassVar[int] = 1
    _deals: ClassVar[Iterable[int]] = itertools.count()  # the factory's own; trl_environment makes a new one

    def __init__(self) -> None:
        self.env = BlackjackEnv(solution_for(self.rules), self.settings)
        # whether the last reset returned the prompt (TRL shows it as one user turn) rather than
        # the row's prompt showing the deal: what the model saw, for the fidelity callback
        self.prompt_from_reset = False

    def reset(self, seed: int | None = None, prompt: Any = None, **row: Any) -> str | None:
        """Deal a fresh hand: the row's seed, or the factory's next one when the row has none.

        A row with its prompt (from `prompt_dataset`) returns None: the prompt already shows the
        deal. Without a prompt (no dataset, or rows of seeds only) the prompt is returned, our
        system prompt and the hand in one text, for TRL to put in the user turn.
        """
        has_prompt = _has_content(prompt)
        if seed is None:
            if has_prompt:
                raise ValueError("a dataset row with a prompt needs its `seed` column: build the dataset with prompt_dataset()")
            seed = self.first_seed + next(self._deals) // self.group_size
        messages, _ = self.env.reset(int(seed))
        self.prompt_from_reset = not has_prompt
        if has_prompt:
            return None
        return reset_prompt(messages)

    def take_action(self, action: str) -> str:
        """Play your turn in Blackjack.

        Args:
            action: Either 'hit' (take another card) or 'stick' (keep your hand and end your turn).

        Returns:
            Your new hand, or how the game ended.
        """
        if self.env.done:
            raise GameOver("The game is over; no more actions are possible.")
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"action": action}}}
        text, _, terminated, truncated, info = self.env.step("", [call])
        if text is not None and not truncated:
            return text
        play = self.env.play
        if play.status == "finished":
            return f"The game is over: you {'won' if play.outcome == 'win' else 'lost' if play.outcome == 'loss' else 'drew'}."
        return f"The game is over: {info['parse']['detail'] or play.invalid_reason}."

    def get_reward(self) -> float:
        """The rollout's reward (TRL calls it once the rollout is over): the episode's score.

        A hand still open when the rollout ended had a last message without a call TRL could
        run: that is an answer without a call, which ends the episode as invalid (no re-prompt,
        the rollout is over). Asking again returns the same score.
        """
        if self.env.observation is None:
            raise RuntimeError("get_reward() before reset(): no hand was dealt")
        if not self.env.done:
            self.env.step("", None, allow_retry=False)
        return float(self.env.play.score)


def reset_prompt(messages: list[dict]) -> str:
    """The prompt `reset` returns for a deal's opening messages: our system prompt and the hand in one text."""
    return "\n\n".join(message["content"] for message in messages)


def _has_content(prompt: Any) -> bool:
    """Whether a row's prompt shows anything (TRL's dataset-less rows carry one empty user turn)."""
    if isinstance(prompt, str):
        return bool(prompt)
    if isinstance(prompt, list):
        return any(_has_content(m.get("content")) if isinstance(m, dict) else bool(m) for m in prompt)
    return prompt is not None


def trl_environment(
    natural: bool = False, sab: bool = False, first_seed: int = 0, group_size: int = 1, **settings: Any
) -> type[BlackjackTRLEnv]:
    """An `environment_factory` for other rules or `EnvSettings` (TRL calls it with no arguments).

    `first_seed` and `group_size` apply without a dataset: resets deal first_seed, first_seed + 1,
    ... each `group_size` times in a row. Set `group_size` to `num_generations` so that a GRPO
    group plays one deal (TRL resets a group's rollouts one after another in a process).
    """
    if not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"group_size must be a whole number of at least 1, not {group_size!r}")
    if not (isinstance(first_seed, int) and 0 <= first_seed < 2**63):
        raise ValueError(f"first_seed must be a whole number from 0 to 2**63 - 1, not {first_seed!r}")
    attrs = {"rules": Rules(natural=natural, sab=sab), "settings": EnvSettings(**settings),
             "first_seed": first_seed, "group_size": group_size, "_deals": itertools.count()}
    return type(BlackjackTRLEnv.__name__, (BlackjackTRLEnv,), attrs)


def blackjack_reward(completions: list, environments: list | None = None, **kwargs: Any) -> list[float]:
    """Each rollout's score from the environment that played it: what `get_reward()` gives TRL.

    For scoring or logging outside the trainer. GRPOTrainer already takes `get_reward()` as a
    reward source, so passing this as a reward function as well would count the score twice.
    """
    if environments is None:
        raise ValueError("blackjack_reward needs the environments that played the completions (BlackjackTRLEnv)")
    if "trainer_state" in kwargs and any(isinstance(env, BlackjackTRLEnv) for env in environments):
        raise ValueError("GRPOTrainer already takes BlackjackTRLEnv.get_reward() as the reward: drop reward_funcs=blackjack_reward")
    return [env.get_reward() for env, _ in zip(environments, completions, strict=True)]


def prompt_rows(seeds: Iterable[int], natural: bool = False, sab: bool = False, thinking: bool = False) -> list[dict]:
    """One row per deal: `prompt` (our system prompt and the dealt hand) and `seed`."""
    env = BlackjackEnv(solution_for(Rules(natural=natural, sab=sab)), EnvSettings(thinking=thinking))
    rows = [{"prompt": env.reset(int(seed))[0], "seed": int(seed)} for seed in seeds]
    env.close()
    return rows


def prompt_dataset(seeds: Iterable[int], natural: bool = False, sab: bool = False, thinking: bool = False):
    """The `datasets.Dataset` that `GRPOTrainer` trains on (use `evaluate`'s seeds only to evaluate)."""
    from datasets import Dataset

    return Dataset.from_list(prompt_rows(seeds, natural, sab, thinking))


def tool_chat_tokenizer(tokenizer: Any) -> Any:
    """Make a tokenizer ready for TRL's tool loop. A ChatML template that cannot render tool calls
    (SmolLM2's has no tool role, so TRL refuses it) is replaced by TRL's Qwen3 ChatML template,
    whose `<tool_call>` blocks are the format our prompt teaches; TRL then renders and parses calls."""
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        if "<|im_start|>" not in tokenizer.get_vocab():
            raise ValueError(
                "this tokenizer's chat template cannot render tool calls and it is not ChatML: "
                "set a tool-calling template TRL knows (see trl.chat_template_utils)"
            )
        tokenizer.chat_template = qwen3_chat_template
    try:
        add_response_schema(tokenizer)
    except ValueError:
        if not (getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)):
            raise ValueError(
                "TRL cannot parse tool calls with this tokenizer's chat template: set its response_template "
                "(transformers' response parsing) or use a template TRL knows (see trl.chat_template_utils)"
            ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
