"""TRL: an `environment_factory` class for `GRPOTrainer`, and the prompt dataset it trains on.

    trainer = GRPOTrainer(model=..., processing_class=tool_chat_tokenizer(tok),
                          train_dataset=prompt_dataset(range(1000)),
                          environment_factory=BlackjackTRLEnv, reward_funcs=blackjack_reward,
                          args=GRPOConfig(...))

TRL creates one instance per rollout and calls `reset(**row)` with the dataset row; the
public method `take_action` becomes the model's tool (its docstring is the schema). The
reward is a reward function rather than the env's `get_reward` because the rollout's last
answer (the one TRL found no call in) must be read by our parser too: it is an answer like
any other, so the reward equals `BlackjackEnv`'s for the same deal and the same answers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

from blackjack_rl.env import BlackjackEnv, EnvSettings, solution_for
from blackjack_rl.game.table import Rules
from blackjack_rl.contract.protocol import TOOL_NAME


class GameOver(RuntimeError):
    """Raised by `take_action` after the hand ended; TRL shows the message to the model."""


class BlackjackTRLEnv:
    """One Blackjack hand per rollout; `trl_environment(...)` makes one with other rules or scoring.

    Every public method is a tool to TRL, so this class has exactly one: `take_action`.
    """

    rules: Rules = Rules()
    settings: EnvSettings = EnvSettings()

    def __init__(self) -> None:
        self.env = BlackjackEnv(solution_for(self.rules), self.settings)

    def reset(self, seed: int | None = None, **row: Any) -> str | None:
        """Deal the row's seed. The row's prompt already shows this deal, so nothing is appended."""
        if seed is None:
            raise ValueError("each dataset row needs a `seed` column: build the dataset with prompt_dataset()")
        self.env.reset(int(seed))
        return None

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

    def _finish(self, completion: list[dict[str, Any]] | str) -> float:
        """Score the rollout. Its last answer had no call TRL could parse; our parser reads it as
        the episode's next answer (no re-prompt: the rollout is over). A hand still unfinished
        after it ends as truncated ("rollout_ended"), scored like an invalid answer."""
        if not self.env.done:
            last = completion if isinstance(completion, str) else _final_answer(completion)
            if last is not None:
                self.env.step(last, allow_retry=False)
            if not self.env.done:
                self.env.truncate("rollout_ended")
        return float(self.env.play.score)


def trl_environment(natural: bool = False, sab: bool = False, **settings: Any) -> type[BlackjackTRLEnv]:
    """An `environment_factory` for other rules or `EnvSettings` (TRL calls it with no arguments)."""
    attrs = {"rules": Rules(natural=natural, sab=sab), "settings": EnvSettings(**settings)}
    return type(BlackjackTRLEnv.__name__, (BlackjackTRLEnv,), attrs)


def _final_answer(completion: list[dict[str, Any]]) -> str | None:
    """The text of the last assistant message, when TRL did not run it as tool calls."""
    if not completion or completion[-1].get("role") != "assistant" or completion[-1].get("tool_calls"):
        return None
    content = completion[-1].get("content")
    if isinstance(content, list):  # content blocks
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else None


def blackjack_reward(completions: list, environments: list | None = None, **_: Any) -> list[float]:
    """TRL reward function: each rollout's episode score, from the environment that played it."""
    if environments is None:
        raise ValueError("blackjack_reward needs GRPOTrainer(environment_factory=BlackjackTRLEnv)")
    return [env._finish(completion) for env, completion in zip(environments, completions, strict=True)]


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


# Transformers' response-parsing spec (>= 5.13) for a ChatML answer with Hermes `<tool_call>` blocks.
# TRL < 1.0 sets only the older `response_schema`, which those transformers no longer read.
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant", "content": ""},  # TRL 0.x reads `content` even when a call is all
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def _trl_major() -> int:
    from importlib.metadata import version

    return int(version("trl").split(".")[0])


def tool_chat_tokenizer(tokenizer: Any) -> Any:
    """Make a tokenizer ready for TRL's tool loop. A ChatML template TRL cannot parse tool calls
    from (SmolLM2's has no tool role) is replaced by TRL's Qwen3 ChatML template, whose
    `<tool_call>` blocks are the format our prompt teaches; TRL then renders and parses calls."""
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    try:
        add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>" not in tokenizer.get_vocab():
            raise ValueError(
                "TRL cannot parse tool calls with this tokenizer's chat template and it is not ChatML: "
                "set a template TRL knows (see trl.chat_template_utils)"
            ) from None
        tokenizer.chat_template = qwen3_chat_template
        add_response_schema(tokenizer)
    if getattr(tokenizer, "response_template", None) is None:
        tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    if _trl_major() < 1 and "prefix" in inspect.signature(tokenizer.parse_response).parameters:
        # TRL 0.x calls parse_response(ids) on the completion alone; newer transformers then ask
        # for the prompt prefix, which a Hermes answer does not need (nothing is pre-written).
        tokenizer.parse_response = functools.partial(tokenizer.parse_response, prefix="")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
