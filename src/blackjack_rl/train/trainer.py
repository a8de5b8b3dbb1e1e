"""The trainer: get a step's groups, take a GRPO step, log, evaluate, checkpoint, plot.

Everything a run leaves is in `--out`:
    command.txt          the command line
    settings.json        every resolved setting
                         (both with portable paths, never an absolute one: train/portable.py)
    train_log.jsonl      one row per step ("kind": "step") and per evaluation ("kind": "eval")
    eval/step_NNNN.json  the full `evaluate` metrics of each evaluation
    checkpoints/         every --save-every steps (LoRA: the adapter only)
    model/               the final model: safetensors + tokenizer (`--policy hf --model-path`)
    adapter/             LoRA runs: the adapter alone (`--policy hf --model-path OUT/adapter`)
    curves.png           the curves

The trainer asks the policy that plays its groups for what `TrainedPolicy` declares and nothing
else: the model it samples with, to wrap for training and hand back (`sample_with`), and the
states of the frozen trunk recorded while a batch is collected (`recording`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import shlex
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from blackjack_rl.config import Settings
from blackjack_rl.jobs.fidelity import PROBE_BUDGET, PROBE_WIDTH, exact_fidelity, samples_of
from blackjack_rl.contract.protocol import STICK, tool_call_text
from blackjack_rl.contract.records import ScoredDataGroup
from blackjack_rl.contract.tokens import HFTokenizer
from blackjack_rl.model.base_ref import check_base
from blackjack_rl.model.forward import causal_lm
from blackjack_rl.model.io import add_lora, export_model, load_adapter_weights, save_adapter
from blackjack_rl.model.logprobs import token_logprobs
from blackjack_rl.model.lora_stack import adapter_files, fold_adapter
from blackjack_rl.outputs import prepare_folder
from blackjack_rl.policies.torch.policy import TorchPolicy
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import probe_seeds
from blackjack_rl.train import checkpoints
from blackjack_rl.train.grpo import LossConfig, optimize
from blackjack_rl.train.log import TrainLog, eval_line, fidelity_line, grid_line, step_line
from blackjack_rl.train.metrics import batch_metrics, evaluate_policy, grid_metrics
from blackjack_rl.train.plot import plot_log
from blackjack_rl.train.portable import portable_argv, portable_values
from blackjack_rl.train.sources import ApiSource, GroupSource, LocalSource

COLLAPSE_DROP = 0.15  # a fall of the hit gap from its best that is not noise (the grid has none)


class TrainedPolicy(Protocol):
    """What the trainer asks of the policy whose model it trains (`TorchPolicy` is the one)."""

    name: str
    tokenizer: HFTokenizer
    max_tokens: int
    sampled_tokens: int  # totals so far, for the sampling rate
    sampling_seconds: float
    scored_tokens: int  # tokens of the sequences scored so far: forward work

    @property
    def model(self) -> Any:
        """The model it samples with: what the trainer makes trainable and hands back."""
        ...

    def sample_with(self, model: Any, *, frozen_below: int = 0) -> None:
        """Sample with `model` from now on; the layers below `frozen_below` do not train."""
        ...

    def aside(self) -> AbstractContextManager[None]:
        """Work after which training goes on exactly as without it (a fidelity probe)."""
        ...

    def recording(self) -> AbstractContextManager[dict[tuple[int, ...], torch.Tensor]]:
        """While a batch is collected: the states entering layer `frozen_below` of every sequence
        sampled or scored, keyed by its ids."""
        ...


@dataclass
class TrainResult:
    out: Path
    steps: int
    evals: list[dict[str, Any]] = field(default_factory=list)
    model_dir: Path | None = None
    adapter_dir: Path | None = None  # LoRA runs: the adapter alone, a few MB
    plot: Path | None = None
    stopped: str = "steps"  # "steps", "time", or the stop rule that ended it


def make_trainable(model: Any, settings: Settings) -> Any:
    """LoRA adapters, or full fine-tuning, optionally of the top `train_layers` layers only."""
    t = settings.train
    layers = causal_lm(model).config.num_hidden_layers
    top = list(range(max(0, layers - t.train_layers), layers)) if t.train_layers else None
    if t.lora:
        return add_lora(model, t.lora_rank, t.lora_alpha, layers=top)
    if top is not None:
        for p in model.parameters():
            p.requires_grad_(False)
        core = causal_lm(model).model
        for i in top:
            core.layers[i].requires_grad_(True)
        core.norm.requires_grad_(True)
    return model


def make_reference(model: Any, settings: Settings) -> Callable | None:
    """Logprobs of the initial policy, for the KL term: LoRA switched off, or a frozen copy.

    The layers below the trained ones are shared by both policies, so the reference reads
    the same recorded states entering the first trained layer instead of running them again.
    """
    if settings.train.kl_coef <= 0:
        return None
    temperature = settings.policy.temperature
    if hasattr(model, "disable_adapter"):

        def with_adapters_off(tokens, targets, first_layer=0, states=None):
            with model.disable_adapter():
                return token_logprobs(model, tokens, targets, temperature, first_layer=first_layer, states=states)

        return with_adapters_off
    frozen = copy.deepcopy(model).requires_grad_(False)
    return lambda tokens, targets, first_layer=0, states=None: token_logprobs(
        frozen, tokens, targets, temperature, first_layer=first_layer, states=states
    )


def learning_rate(step: int, lr: float, warmup_steps: int, decay_steps: int = 0, steps: int = 0) -> float:
    """The learning rate of optimizer step `step` (1-based, of `steps`): linear warm-up, constant, then a
    linear decay over the last `decay_steps` that never reaches zero (a step at rate 0 would be spent)."""
    warm = min(1.0, step / warmup_steps) if warmup_steps else 1.0
    left = steps - step + 1  # this step and those after it
    decay = min(1.0, left / (decay_steps + 1)) if decay_steps else 1.0
    return lr * min(warm, decay)


class Trainer:
    """GRPO on the model of `player.policy`, in place, as `settings.train` says.

    `setup` makes the model trainable and opens the group source; `resume` says where the run
    starts (restoring a checkpoint with --resume); then `step` and `evaluate` as the run goes,
    `close`, and `export` for the final model and curves. `run_training` drives them.
    """

    # set by `setup`
    model: Any  # the policy's model, made trainable
    first_layer: int  # the lowest trained layer (0: all train)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    reference: Callable | None  # the initial policy's logprobs, for the KL term
    loss_config: LossConfig

    def __init__(self, settings: Settings, player: Player, progress: Callable[[str], None] = print) -> None:
        if not isinstance(player.policy, TorchPolicy):
            raise ValueError("training needs the torch policy (--policy hf)")
        self.settings, self.player, self.progress = settings, player, progress
        self.policy: TrainedPolicy = player.policy
        self.t = settings.train
        self.out = Path(settings.out)
        self.base = settings.policy.model_path  # the model the run starts from (None: the embedded GGUF)
        self.result = TrainResult(self.out, 0)
        self.source: GroupSource | None = None
        self.log: TrainLog | None = None
        self.started = time.monotonic()
        self.measuring = 0.0  # seconds spent on charts and evaluations, which are not training
        self.best_gap: float | None = None
        self.probe_seeds: list[int] | None = None  # --fidelity-every's fixed deals, found once

    # --- setup --------------------------------------------------------------------------------

    def setup(self, argv: Sequence[str] = ()) -> None:
        """Write the run's command and settings, make the model trainable (over a --base-adapter,
        from an --init-adapter) and hand it to the policy to sample with, and open the source."""
        t = self.t
        self._write_run_files(argv)
        torch.manual_seed(self.settings.seed)
        self.model = self._trainable_model()
        # Below this layer nothing trains: sampling records the states entering it, and training
        # runs only the layers above (the states are valid as long as the trunk is frozen).
        layers = causal_lm(self.model).config.num_hidden_layers
        self.first_layer = max(0, layers - t.train_layers) if t.train_layers else 0
        self.policy.sample_with(self.model, frozen_below=self.first_layer)  # the model that learns plays
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.progress(f"training {sum(p.numel() for p in self.params):,} of "
                      f"{sum(p.numel() for p in self.model.parameters()):,} parameters "
                      f"({'LoRA' if t.lora else 'full'}" + (f", top {t.train_layers} layers" if t.train_layers else "")
                      + ")")
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(0.9, t.adam_beta2), eps=t.adam_eps)
        self.reference = make_reference(self.model, self.settings)
        self.loss_config = LossConfig(t.clip_eps, t.kl_coef, self.settings.policy.temperature, t.scale_advantages)
        self.source = self._source()
        self._warn_short_answers()

    def _write_run_files(self, argv: Sequence[str]) -> None:
        prepare_folder(self.out)
        (self.out / "command.txt").write_text("blackjack-rl " + shlex.join(portable_argv(list(argv), self.out))
                                              + "\n", encoding="utf-8")
        values = portable_values(self.settings.model_dump(mode="json"), self.out)
        (self.out / "settings.json").write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")

    def _trainable_model(self) -> Any:
        t = self.t
        model = self.policy.model
        if t.base_adapter is not None:  # with --lora and no --init-adapter (TrainConfig)
            model = fold_adapter(model, t.base_adapter, self.base)
            self.progress(f"a fresh LoRA adapter trains over {t.base_adapter}")
        model = make_trainable(model, self.settings)
        if t.init_adapter is not None:
            adapter_files(t.init_adapter)
            check_base(t.init_adapter, self.base)
            load_adapter_weights(model, t.init_adapter)
            self.progress(f"LoRA adapters start from {t.init_adapter}")
        return model

    def _source(self) -> GroupSource:
        t, s = self.t, self.settings
        if t.source == "api":
            return ApiSource(
                t.api_url,
                token=t.api_token,
                batch_size=t.batch_size or t.deals_per_step * s.groups.group_size,
                max_token_len=s.episode.max_token_length,
                steps=t.steps,
                checkpoint_dir=str(self.out / "checkpoints"),
                save_every=t.save_every,
                timeout_s=t.batch_timeout,
            )
        return LocalSource(self.player, s.groups, t.deals_per_step, s.seed)

    def _warn_short_answers(self) -> None:
        need = len(self.player.chat.answer_ids(tool_call_text(STICK)))
        have = self.policy.max_tokens
        if have < need:
            self.progress(f"warning: --max-tokens {have} cannot hold a whole call with its end-of-turn token "
                          f"({need} tokens): answers will be cut and scored invalid")

    # --- resume -------------------------------------------------------------------------------

    def resume(self) -> int:
        """The first step to take: 1, or with --resume the one after the checkpoint's, whose
        parameters, optimizer, deal stream and torch random state are restored. The log starts
        afresh, or goes on."""
        t = self.t
        first = 1
        if t.resume is not None:
            first = checkpoints.restore(t.resume, self.model, self.optimizer, self.source, base=self.base,
                                        base_adapter=t.base_adapter) + 1
            self.progress(f"resumed from {t.resume} at step {first}")
        self.result.steps = first - 1
        self.log = TrainLog(self.out / "train_log.jsonl", append=t.resume is not None)
        self.started = time.monotonic()
        return first

    # --- the run ------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step on a step's groups, played by the current weights, with the chart
        when due; logged, printed, and checkpointed when due. Returns the step's log row."""
        t, policy = self.t, self.policy
        t0 = time.perf_counter()
        tokens0, seconds0 = policy.sampled_tokens, policy.sampling_seconds
        with policy.recording() as states:
            groups, info = self.source.next_groups()
        row: dict[str, Any] = {"kind": "step", "step": step, **batch_metrics(groups), **info}
        sampled = policy.sampled_tokens - tokens0
        spent = policy.sampling_seconds - seconds0
        row["sampled_tokens"] = sampled
        row["sample_tokens_per_s"] = sampled / spent if spent > 0 else None
        if t.fidelity_every and step % t.fidelity_every == 0:
            f0 = time.monotonic()
            row.update(self._fidelity(groups))
            row["fidelity_seconds"] = time.monotonic() - f0
            self.measuring += row["fidelity_seconds"]
            self.progress(fidelity_line(row))
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate(step, t.lr, t.warmup_steps, t.decay_steps, t.steps)
        row["lr"] = self.optimizer.param_groups[0]["lr"]
        row.update(optimize(self.model, self.optimizer, self.params, groups, self.loss_config, self.settings,
                            self.reference, self.first_layer, states))
        row["seconds"] = time.perf_counter() - t0
        row["elapsed"] = time.monotonic() - self.started - self.measuring  # training time: --max-minutes counts it
        if t.grid_every and step % t.grid_every == 0:
            g0 = time.monotonic()
            row.update(self._grid(step))
            row["grid_seconds"] = time.monotonic() - g0
            self.measuring += row["grid_seconds"]
        self.log.write(row)
        self.progress(step_line(row, t.steps))
        if "grid_accuracy" in row:
            self.progress(grid_line(row))
        self.result.steps = step
        if t.save_every and step % t.save_every == 0:
            state = checkpoints.trainer_state(step, self.optimizer, self.source, t.base_adapter)
            checkpoints.save(self.model, policy.tokenizer, self.out / "checkpoints" / f"step_{step:04d}", state,
                             t.base_adapter, self.base)
        return row

    def _fidelity(self, groups: list[ScoredDataGroup]) -> dict[str, Any]:
        """The step's credit against the exact advantage A^pi of the policy that played it, before
        the step trains on it. Local: on fixed probe deals played as the step's were (the same
        weights, credit and continuation); api: on the pulled batch, whose answers another policy
        may have sampled, against the trainer's. The probe leaves training exactly as it was."""
        policy, local = self.policy, isinstance(self.source, LocalSource)
        row: dict[str, Any] = {"fidelity_of": "probe" if local else "batch", "fidelity_policy": "trainer"}
        with policy.aside():
            if local:
                if self.probe_seeds is None:
                    self.probe_seeds = probe_seeds(self.player, self.settings.groups, self.t.fidelity_probes)
                c0, tokens0 = time.monotonic(), policy.sampled_tokens + policy.scored_tokens
                groups = self.source.probe(self.probe_seeds)
                row["fidelity_credit_seconds"] = time.monotonic() - c0
                row["fidelity_credit_tokens"] = policy.sampled_tokens + policy.scored_tokens - tokens0
                row["fidelity_deals"] = len(self.probe_seeds)
            samples = samples_of(groups, self.player, self.loss_config.scale_advantages)
            if not samples:
                return {**row, "fidelity": None}
            fidelity = asyncio.run(exact_fidelity(samples, self.player, budget=PROBE_BUDGET, target_width=PROBE_WIDTH))
        return {**row, "fidelity": fidelity.to_dict()}

    def out_of_time(self, row: dict[str, Any]) -> bool:
        """Whether --max-minutes of training have passed by this step's row (the run then stops)."""
        minutes = self.t.max_minutes
        if minutes is None or row["elapsed"] <= 60 * minutes:
            return False
        self.result.stopped = "time"
        self.progress(f"stopping after {row['elapsed'] / 60:.1f} min (--max-minutes {minutes})")
        return True

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """The fixed evaluation deals played by the current weights, logged (None: --eval-episodes 0)."""
        if self.t.eval_episodes <= 0:
            return None
        e0 = time.monotonic()
        row = evaluate_policy(self.player, self.settings, step, self.out)
        self.result.evals.append(row)
        self.log.write(row)
        self.progress(eval_line(row))
        self.measuring += time.monotonic() - e0
        return row

    def chart(self, step: int) -> dict[str, Any] | None:
        """The exact strategy chart of the current weights as a log row of its own (None: --grid-every 0);
        the chart before training. Later charts are part of their step's row."""
        if not self.t.grid_every:
            return None
        g0 = time.monotonic()
        row = {"kind": "grid", "step": step, **self._grid(step)}
        self.log.write(row)
        self.progress(grid_line(row))
        self.measuring += time.monotonic() - g0
        return row

    def _grid(self, step: int) -> dict[str, Any]:
        row = grid_metrics(self.player, self.settings)
        gap = row["grid_hit_gap"]
        if self.best_gap is not None and self.best_gap - gap > COLLAPSE_DROP:
            row["collapse_alarm"] = True
            self.progress(f"warning: step {step}: P(hit) on hit-optimal cells minus on stick-optimal cells fell from "
                          f"{self.best_gap:.2f} to {gap:.2f}: the policy is drifting toward one constant action")
        self.best_gap = gap if self.best_gap is None else max(self.best_gap, gap)
        return row

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.log is not None:
            self.log.close()

    # --- export -------------------------------------------------------------------------------

    def export(self) -> TrainResult:
        """The final model (LoRA: the adapter alone first, the small file a run is kept for) and the curves."""
        t, out, tokenizer = self.t, self.out, self.policy.tokenizer
        if hasattr(self.model, "peft_config"):
            self.result.adapter_dir = save_adapter(self.model, tokenizer, out / "adapter", self.base, t.base_adapter)
        self.result.model_dir = export_model(self.model, tokenizer, out / "model")
        groups = self.settings.groups
        self.result.plot = plot_log(
            out / "train_log.jsonl",
            out / "curves.png",
            f"GRPO on {self.policy.name}, T={self.settings.policy.temperature}, "
            f"{groups.group_by} groups of {groups.group_size}, lr {t.lr}",
        )
        return self.result


def run_training(
    settings: Settings,
    player: Player,
    argv: list[str] | None = None,
    progress: Callable[[str], None] = print,
    stop: Callable[[dict[str, Any]], str | None] | None = None,
) -> TrainResult:
    """Train `player.policy` (a TorchPolicy) in place, as `settings.train` says. `stop` may end
    the run after a step: it is given the step's row and returns why it stops, or None."""
    t = settings.train
    trainer = Trainer(settings, player, progress)
    try:
        trainer.setup(argv or [])
        first = trainer.resume()
        if first == 1:
            trainer.evaluate(0)
            trainer.chart(0)
        for step in range(first, t.steps + 1):
            row = trainer.step(step)
            if trainer.out_of_time(row):
                break
            reason = stop(row) if stop is not None else None
            if reason is not None:
                trainer.result.stopped = reason
                progress(f"stopping after step {step}: {reason}")
                break
            if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                trainer.evaluate(step)
        trainer.evaluate(trainer.result.steps)
    finally:
        trainer.close()
    return trainer.export()
