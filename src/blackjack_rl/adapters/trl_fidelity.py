"""Advantage fidelity inside a TRL run: the credit TRL's GRPO gives, against the exact advantage.

    trainer = GRPOTrainer(..., environment_factory=BlackjackTRLEnv, args=GRPOConfig(...))
    trainer.add_callback(FidelityCallback(trainer, every=10, out="fidelity.jsonl"))

Every `every` steps, the rollouts of the batch TRL just generated are scored as
`blackjack-rl fidelity` scores a groups file (measure/fidelity.py): each rollout's decisions,
replayed from the deal seed and the actions its `BlackjackTRLEnv` recorded, carry the advantage
TRL computed for the rollout (scalar GRPO: every decision of an episode gets its episode's), and
the truth is A^pi(h, a) of the model TRL trains, with the weights that sampled the batch (before
the step's optimizer update), at the prompts TRL builds: its chat template and tool schema, the
canonical call, then TRL's tool turn with the next hand.

TRL has no public view of its advantages, so this reads GRPOTrainer internals of TRL 1.16, the
version the `trl` extra pins: `_logs["advantages"]` (the batch's advantages in rollout order, as
TRL logs them), `_buffered_inputs` (a new object for each batch TRL generates) and
`_get_tool_suffix_ids` (the tokens of a tool turn).
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from transformers import TrainerCallback

from blackjack_rl.adapters.trl_env import BlackjackTRLEnv, reset_prompt
from blackjack_rl.contract.protocol import HIT, STICK, TOOL_NAME
from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer
from blackjack_rl.env import opening_messages, solution_for
from blackjack_rl.game.table import Table
from blackjack_rl.jobs.fidelity import PROBE_BUDGET, PROBE_WIDTH, Fidelity, exact_fidelity
from blackjack_rl.measure.fidelity import CreditSample, episode_histories
from blackjack_rl.model.forward import check_architecture
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.policies.torch.policy import TorchPolicy
from blackjack_rl.rollout.core import EpisodeSettings
from blackjack_rl.rollout.players import Player

TESTED_TRL = "1.16"  # the GRPOTrainer internals read here (module docstring) are those of this release


@dataclass(frozen=True, slots=True)
class TrainedRollout:
    """One rollout TRL trained on: its deal, the call of each answer, and TRL's advantage."""

    seed: int
    actions: tuple[str | None, ...]  # "hit" / "stick" per answer; None: not a valid call
    advantage: float  # what TRL's loss multiplies every token of the rollout by
    replayable: bool  # False: re-prompted or unscored, so its history is not the canonical one


def rollout_samples(rollouts: Sequence[TrainedRollout], table: Table) -> list[CreditSample]:
    """Each decision of each rollout, at its history, with its rollout's advantage: a scalar
    GRPO advantage is every decision's credit (measure/fidelity.py reads an episode group so)."""
    out = []
    for r in rollouts:
        if not r.replayable:
            continue
        for history, action in zip(episode_histories(table, r.seed, r.actions), r.actions):
            if action is None:
                break
            out.append(CreditSample(history, HIT if action == "hit" else STICK, r.advantage))
    return out


@dataclass(frozen=True)
class FidelityReading:
    """One batch's credit against A^pi, and what the reading cost (outside the training budget)."""

    step: int  # the optimizer step that trains on the batch
    rollouts: list[TrainedRollout]
    samples: list[CreditSample]
    fidelity: Fidelity | None  # None: no valid decision in the batch
    forward_tokens: int  # tokens of the sequences the truth scored
    seconds: float

    def record(self) -> dict[str, Any]:
        """The JSONL row: the scores as `train --fidelity-every` logs them."""
        return {"kind": "fidelity", "step": self.step, "fidelity_of": "batch", "fidelity_policy": "trainer",
                "rollouts": len(self.rollouts), "credits": len(self.samples),
                "fidelity_tokens": self.forward_tokens, "fidelity_seconds": self.seconds,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None}

    def log_row(self) -> dict[str, Any]:
        """The row for TRL's `state.log_history`: flat numbers, like the rows TRL logs."""
        row: dict[str, Any] = {"step": self.step, "fidelity/rollouts": len(self.rollouts),
                               "fidelity/credits": len(self.samples), "fidelity/tokens": self.forward_tokens,
                               "fidelity/seconds": self.seconds}
        for part, scores in (self.fidelity.scores.items() if self.fidelity else ()):
            prefix = "fidelity/" if part == "all" else f"fidelity/{part}/"
            row.update({prefix + k: v for k, v in scores.to_dict().items() if v is not None})
        return row


@dataclass
class ToolChatFormat(ChatFormat):
    """The prompts TRL builds, for the truth's probe (`history_ids`): the opening rendered with
    TRL's template and tool schema, and each later hand as TRL's tool turn."""

    trainer: Any = None
    prompt_from_reset: bool = False  # no dataset: TRL shows `reset`'s text as one user turn
    _tool_cache: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, chat: ChatFormat, trainer: Any, prompt_from_reset: bool) -> "ToolChatFormat":
        base = {f.name: getattr(chat, f.name) for f in fields(ChatFormat) if not f.name.startswith("_")}
        return cls(**base, trainer=trainer, prompt_from_reset=prompt_from_reset)

    def shown(self, messages: Sequence[dict]) -> list[dict]:
        """The opening messages as TRL shows them."""
        if self.prompt_from_reset:
            return [{"role": "user", "content": reset_prompt(list(messages))}]
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        key = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)
        ids = self._prompt_cache.get(key)
        if ids is None:
            t = self.trainer
            rendered = t.processing_class.apply_chat_template(  # as GRPOTrainer._tokenize_prompts renders
                conversation=[self.shown(messages)], tools=t.tools or None, chat_template=t.chat_template,
                add_generation_prompt=True, tokenize=True, return_dict=True, **t.chat_template_kwargs)
            ids = self._prompt_cache[key] = [int(i) for i in rendered["input_ids"][0]]
        return list(ids)

    def next_turn_ids(self, user_text: str) -> list[int]:
        ids = self._tool_cache.get(user_text)
        if ids is None:
            turn = [{"role": "tool", "name": TOOL_NAME, "content": user_text}]
            ids = self._tool_cache[user_text] = [int(i) for i in self.trainer._get_tool_suffix_ids(turn)]
        return list(ids)


class FidelityCallback(TrainerCallback):
    """Every `every` steps: the credit TRL gave the rollouts it just generated, against the
    exact advantage A^pi of the model it trains (module docstring).

    The reading runs after the step's backward pass and before its optimizer update, with
    gradients off, the model's mode and the random state put back: TRL trains the same numbers
    as without it. Each reading is appended to `trainer.state.log_history` (flat `fidelity/...`
    keys) and, with `out`, to that JSONL file, with its forward tokens and seconds; `readings` keeps
    the newest `keep` of them in memory (each holds a batch's rollouts), so a long run does not
    grow it. With several
    processes, the main one scores its own rollouts. `budget` and `target_width` size each
    Q^pi(h, hit) tree as `train --fidelity-every` does.
    """

    def __init__(self, trainer: Any, every: int = 10, *, out: str | Path | None = None,
                 budget: int = PROBE_BUDGET, target_width: float = PROBE_WIDTH, keep: int = 100) -> None:
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every must be a whole number of steps, at least 1, not {every!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"keep must be a whole number of readings, at least 1, not {keep!r}")
        if getattr(trainer, "environment_factories", None) is None:
            raise ValueError("FidelityCallback needs a GRPOTrainer with environment_factory=BlackjackTRLEnv")
        if not all(hasattr(trainer, a) for a in ("_logs", "_buffered_inputs", "_get_tool_suffix_ids")):
            raise ValueError(f"this TRL's GRPOTrainer lacks the internals FidelityCallback reads: use trl {TESTED_TRL}.x")
        check_architecture(trainer.model)
        self.trainer = trainer
        self.every = every
        self.out = Path(out) if out is not None else None
        self.budget, self.target_width = budget, target_width
        self.readings: deque[FidelityReading] = deque(maxlen=keep)
        self._due = every  # the first step whose new batch is scored
        self._seen: Any = None  # the generation batch last seen
        self._player: Player | None = None  # built at the first reading, from the batch's environments

    @property
    def _chat(self) -> ToolChatFormat | None:
        """The prompts the truth reads (the player's chat format), once a reading has built it."""
        return self._player.chat if self._player is not None else None  # type: ignore[return-value]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        batch = self.trainer._buffered_inputs
        if batch is None or batch is self._seen:
            return  # no new batch in this step (TRL generates every steps_per_generation steps)
        self._seen = batch
        step = state.global_step + 1
        if step < self._due or not state.is_world_process_zero:
            return
        self._due = step + self.every
        reading = self.read(step)
        self.readings.append(reading)
        state.log_history.append(reading.log_row())
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with self.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(reading.record()) + "\n")

    def read(self, step: int) -> FidelityReading:
        """The batch TRL generated last, scored against the model's A^pi now."""
        import torch

        t0 = time.monotonic()
        envs = list(self.trainer.environments or [])
        if not envs or not all(isinstance(env, BlackjackTRLEnv) for env in envs):
            raise ValueError("FidelityCallback scores BlackjackTRLEnv rollouts: pass environment_factory=BlackjackTRLEnv "
                             "or a trl_environment(...)")
        player = self.player(envs)
        policy = player.policy
        rollouts = self.batch_rollouts(envs, player.chat)
        table = player.tables.acquire()
        try:
            samples = rollout_samples(rollouts, table)
        finally:
            player.tables.release(table)
        model = self.trainer.model
        training, tokens0 = model.training, policy.scored_tokens
        fidelity = None
        if samples:
            with torch.random.fork_rng(devices=[]):
                model.eval()
                try:
                    fidelity = asyncio.run(exact_fidelity(samples, player, budget=self.budget,
                                                          target_width=self.target_width))
                finally:
                    model.train(training)
        return FidelityReading(step, rollouts, samples, fidelity, policy.scored_tokens - tokens0,
                               time.monotonic() - t0)

    def batch_rollouts(self, envs: list[BlackjackTRLEnv], chat: ToolChatFormat) -> list[TrainedRollout]:
        """This process's rollouts of the last batch, each with the advantage TRL logged for it;
        each prompt TRL showed must be the one the truth's probe builds."""
        t = self.trainer
        n, rank, processes = len(envs), t.accelerator.process_index, t.accelerator.num_processes
        logged = list(t._logs["advantages"])[-n * processes:][rank * n:(rank + 1) * n]
        prompts = list(t._logs["prompt"])[-n * processes:][rank * n:(rank + 1) * n]
        if len(logged) != n or len(prompts) != n:
            raise RuntimeError(f"TRL logged {len(logged)} advantages for {n} rollouts: not the trl {TESTED_TRL} "
                               "this callback reads")
        out = []
        for env, advantage, prompt in zip(envs, logged, prompts):
            play = env.env.play
            if play.decisions:
                opening = chat.shown(opening_messages(play.decisions[0].observation, env.settings.thinking))
                if [{"role": m["role"], "content": m["content"]} for m in prompt[:len(opening)]] != opening:
                    raise ValueError(f"the prompt TRL showed for deal {play.seed} is not its opening prompt: "
                                     "fidelity needs rows from prompt_dataset() or no dataset")
            out.append(TrainedRollout(int(play.seed), tuple(d.action for d in play.decisions), float(advantage),
                                      not play.retries and play.score is not None and math.isfinite(advantage)))
        return out

    def player(self, envs: list[BlackjackTRLEnv]) -> Player:
        """The model TRL trains as our torch policy, at TRL's temperature, with TRL's prompts
        (in the form these rollouts' resets made TRL show); built once."""
        kinds = {env.prompt_from_reset for env in envs}
        if len(kinds) > 1:
            raise ValueError("a batch mixes dataset prompts and prompts from reset(): fidelity needs one kind")
        from_reset = kinds.pop()
        if self._player is None:
            self._player = self._new_player(type(envs[0]), from_reset)
        elif self._player.chat.prompt_from_reset != from_reset:  # type: ignore[attr-defined]
            self._player.chat = ToolChatFormat.of(self._player.policy.chat, self.trainer, from_reset)  # type: ignore[attr-defined]
        return self._player

    def _new_player(self, factory: type[BlackjackTRLEnv], from_reset: bool) -> Player:
        t, args = self.trainer, self.trainer.args
        with tempfile.TemporaryDirectory() as tmp:  # our tokenizer wrapper, on a copy of TRL's tokenizer
            t.processing_class.save_pretrained(tmp)
            tokenizer = HFTokenizer(tmp, via_transformers=True)
        policy = TorchPolicy(t.model, tokenizer, sampling=Sampling(temperature=float(args.temperature),
                                                                   max_tokens=int(args.max_completion_length)))
        s = factory.settings
        # TRL runs at most max_tool_calling_iterations calls: a hit as the last of them leaves
        # the hand open and the rollout ends invalid, as the env's max_turns truncation does
        limit = getattr(t, "max_tool_calling_iterations", None) or s.max_turns
        settings = EpisodeSettings(**{**{f.name: getattr(s, f.name) for f in fields(s)},
                                      "max_turns": min(s.max_turns, int(limit))},
                                   max_token_length=2**31,  # TRL's completion budget: not modelled
                                   max_new_tokens=int(args.max_completion_length))
        return Player(policy, ToolChatFormat.of(policy.chat, t, from_reset), solution_for(factory.rules), settings)
