"""The training loop: get a step's groups, take a GRPO step, log, evaluate, checkpoint, plot.

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
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from blackjack_rl.config import Settings
from blackjack_rl.measure.evaluation import compute_metrics
from blackjack_rl.rollout.runner import run_evaluation
from blackjack_rl.measure.grid import evaluate_grid
from blackjack_rl.rollout.players import Player
from blackjack_rl.measure.probe import probe_policy
from blackjack_rl.contract.protocol import STICK, tool_call_text
from blackjack_rl.policies.torch.forward import causal_lm
from blackjack_rl.policies.torch.logprobs import token_logprobs
from blackjack_rl.policies.torch.base_ref import CONFIG, check_base
from blackjack_rl.policies.torch.lora_stack import adapter_files, fold_adapter, save_lora
from blackjack_rl.policies.torch.model import add_lora, export_model, load_adapter_weights, save_adapter
from blackjack_rl.policies.torch.policy import TorchPolicy
from blackjack_rl.train.grpo import LossConfig, action_balance, carries_signal, group_loss, merge_groups, scalar_advantages, weighted
from blackjack_rl.train.metrics import batch_metrics, eval_summary
from blackjack_rl.train.plot import plot_log
from blackjack_rl.train.portable import portable_argv, portable_values
from blackjack_rl.train.sources import ApiSource, GroupSource, LocalSource


@dataclass
class TrainResult:
    out: Path
    steps: int
    evals: list[dict[str, Any]] = field(default_factory=list)
    model_dir: Path | None = None
    adapter_dir: Path | None = None  # LoRA runs: the adapter alone, a few MB
    plot: Path | None = None
    stopped: str = "steps"  # "steps" or "time"


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


def optimize(
    model: Any,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    groups: list[dict[str, Any]],
    loss_config: LossConfig,
    settings: Settings,
    reference: Callable | None,
    first_layer: int = 0,
    states: dict | None = None,
) -> dict[str, Any]:
    """One GRPO step on a batch of groups (several when --updates-per-batch > 1).

    Groups whose scores are all equal have zero advantage everywhere and are skipped: they
    would cost a forward and backward pass for a zero gradient. The others are trained
    together (`merge_groups`: the shared system prompt runs once per forward), and each
    forward is backpropagated as soon as its loss is known, so memory holds one graph at a time.
    """
    work = []
    weights = action_balance(groups) if settings.groups.balance_actions else [1.0] * len(groups)
    for g, w in zip(groups, weights):
        adv = scalar_advantages(g, loss_config.scale_advantages)
        if carries_signal(g, adv):
            work.append(weighted(g, adv, w))
    stats: dict[str, Any] = {"trained_groups": len(work), "trained_sequences": sum(len(g["tokens"]) for g, _ in work)}
    if not work:
        return stats
    t0 = time.perf_counter()
    # The whole batch, groups without signal included: a batch whose only signal is one
    # invalid answer then makes a small step, not a full-size one.
    sequences = sum(len(g["tokens"]) for g in groups)
    merged = merge_groups(work, settings.train.max_train_rows, drop_zero=loss_config.kl_coef == 0)
    processed = 0
    for _ in range(settings.train.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = gap = kl = 0.0
        tokens = 0
        for g in merged:
            gl = group_loss(model, g, None, loss_config, reference, first_layer=first_layer, states=states)
            (gl.loss / sequences).backward()
            loss_sum += float(gl.loss.detach()) / sequences
            tokens += gl.tokens
            clipped += gl.clipped * gl.tokens
            gap += gl.logprob_gap * gl.tokens
            kl += gl.kl * gl.tokens
            processed += sum(len(t) for t in g["tokens"])
        grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.train.max_grad_norm)
        optimizer.step()
    seconds = time.perf_counter() - t0
    stats.update(
        loss=loss_sum,
        trained_tokens=tokens,
        clipped=clipped / tokens,
        logprob_gap=gap / tokens,
        kl=kl / tokens if settings.train.kl_coef > 0 else None,
        grad_norm=float(grad_norm),
        train_seconds=seconds,
        train_tokens_per_s=processed / seconds if seconds > 0 else None,
    )
    return stats


def learning_rate(step: int, lr: float, warmup_steps: int) -> float:
    """The learning rate of optimizer step `step` (1-based): linear warm-up, then constant."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def evaluate_policy(player: Player, settings: Settings, step: int, out: Path) -> dict[str, Any]:
    """The fixed evaluation deals, played by the current weights, with `evaluate`'s metrics."""
    t0 = time.perf_counter()
    episodes = asyncio.run(
        run_evaluation(player, settings.train.eval_episodes, settings.evaluate.concurrency)
    )
    metrics = compute_metrics(episodes, player)
    metrics.seconds = time.perf_counter() - t0
    (out / "eval").mkdir(parents=True, exist_ok=True)
    (out / "eval" / f"step_{step:04d}.json").write_text(json.dumps(metrics.to_json(), indent=2) + "\n",
                                                          encoding="utf-8")
    return {"kind": "eval", "step": step, "summary": eval_summary(metrics), "seconds": metrics.seconds}


def checkpoint(model: Any, policy: TorchPolicy, path: Path, state: dict[str, Any] | None = None,
               over: Path | None = None, base: str | None = None) -> None:
    """The model (LoRA: the adapter only, stacked `over` a --base-adapter, over `base`: the
    --model-path the run started from, None for the embedded GGUF), and with `state` what resuming
    needs: the trained parameters, the optimizer, the step, and the random states of the deal
    stream and torch."""
    if hasattr(model, "peft_config"):
        save_lora(model, path, over, base)
        policy.tokenizer.tok.save_pretrained(str(path))
    else:
        export_model(model, policy.tokenizer, path)
    if state is not None:
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        tmp = path / "trainer_state.pt.tmp"
        torch.save({**state, "parameters": trained}, tmp)
        tmp.replace(path / "trainer_state.pt")


def _adapter_id(path: Path | None) -> str | None:
    """What a run trained over, by content: a copied adapter folder still resumes."""
    if path is None:
        return None
    return hashlib.sha256(adapter_files(path)[0].read_bytes()).hexdigest()[:16]


def load_trainer_state(path: Path) -> dict[str, Any]:
    file = Path(path) / "trainer_state.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint with trainer state (no trainer_state.pt); "
                                "checkpoints are written by --save-every")
    return torch.load(file, weights_only=False)


COLLAPSE_DROP = 0.15  # a fall of the hit gap from its best that is not noise (the grid has none)


def grid_metrics(player: Player, settings: Settings) -> dict[str, Any]:
    """The exact strategy-chart numbers of the current weights (grid.py), as log fields."""
    probe = asyncio.run(probe_policy(player, settings.policy.temperature, calls_probability=False))
    g = evaluate_grid(player.solution, probe.p_hit)
    return {
        "grid_accuracy": g.accuracy,
        "grid_cell_accuracy": g.cell_accuracy,
        "grid_value": g.value,
        "grid_regret": g.regret,
        "grid_p_hit_hit_optimal": g.p_hit_hit_optimal,
        "grid_p_hit_stick_optimal": g.p_hit_stick_optimal,
        "grid_hit_gap": g.hit_gap,
        "grid_p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None,
        "grid_p_hit": g.p_hit,
    }


def _grid_line(row: dict[str, Any]) -> str:
    return (
        f"  grid @ step {row['step']}: accuracy {100 * row['grid_accuracy']:.1f}%  value {row['grid_value']:+.4f}  "
        f"regret {row['grid_regret']:.4f}  P(hit) hit-optimal {row['grid_p_hit_hit_optimal']:.2f} vs "
        f"stick-optimal {row['grid_p_hit_stick_optimal']:.2f}"
    )


def _warn_short_answers(player: Player, progress: Callable[[str], None]) -> None:
    need = len(player.chat.answer_ids(tool_call_text(STICK)))
    have = getattr(player.policy, "max_tokens", need)
    if have < need:
        progress(f"warning: --max-tokens {have} cannot hold a whole call with its end-of-turn token ({need} "
                 "tokens): answers will be cut and scored invalid")


def _line(row: dict[str, Any], steps: int) -> str:
    def pct(key: str) -> str:
        v = row.get(key)
        return f"{100 * v:5.1f}%" if v is not None else "    -"

    score = row.get("mean_score")
    rate = row.get("sample_tokens_per_s")
    train_rate = row.get("train_tokens_per_s")
    return (
        f"step {row['step']:>4}/{steps}  score {f'{score:+.3f}' if score is not None else '-'}  "
        f"valid {pct('valid_call_rate')}  "
        f"accuracy {pct('decision_accuracy')}  win {pct('win_rate')}  "
        + (f"P(hit) {row['p_hit_hit_optimal']:.2f}|{row['p_hit_stick_optimal']:.2f}  "
           if row.get("p_hit_hit_optimal") is not None and row.get("p_hit_stick_optimal") is not None else "")
        + (f"P(call) {row['p_valid_call']:.3f}  " if row.get("p_valid_call") is not None else "")
        + f"trained {row.get('trained_groups', 0)}/{row['groups']} groups  "
        f"sample {f'{rate:.0f}' if rate else '-'} tok/s  train {f'{train_rate:.0f}' if train_rate else '-'} tok/s  "
        f"{row['seconds']:.0f}s"
        if row.get("groups")
        else f"step {row['step']:>4}/{steps}  no groups"
    )


def _eval_line(row: dict[str, Any]) -> str:
    s = row["summary"]

    def ci(key: str) -> str:
        v = s[key]
        return f"{100 * v['rate']:.1f}% [{100 * v['ci95_low']:.1f}, {100 * v['ci95_high']:.1f}]"

    return (
        f"eval @ step {row['step']}: {s['episodes']} deals  valid answers {ci('valid_decisions')}  "
        f"win {ci('win')}  accuracy {ci('decision_accuracy')}  ({row['seconds']:.0f}s)"
    )


def run_training(
    settings: Settings,
    player: Player,
    argv: list[str] | None = None,
    progress: Callable[[str], None] = print,
) -> TrainResult:
    """Train `player.policy` (a TorchPolicy) in place, as `settings.train` says."""
    t = settings.train
    policy = player.policy
    if not isinstance(policy, TorchPolicy):
        raise ValueError("training needs the torch policy (--policy hf)")
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("blackjack-rl " + shlex.join(portable_argv(argv or [], out)) + "\n",
                                     encoding="utf-8")
    (out / "settings.json").write_text(
        json.dumps(portable_values(settings.model_dump(mode="json"), out), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")
    torch.manual_seed(settings.seed)
    base = settings.policy.model_path  # the model the run starts from (None: the embedded GGUF)

    if t.base_adapter is not None:
        if not t.lora:
            raise ValueError("--base-adapter trains a fresh LoRA adapter over a saved one: it needs --lora")
        if t.init_adapter is not None:
            raise ValueError("use one of --base-adapter (a fresh adapter over a saved one) and --init-adapter "
                             "(continue a saved adapter)")
        policy.model = fold_adapter(policy.model, t.base_adapter, base)
        progress(f"a fresh LoRA adapter trains over {t.base_adapter}")
    model = make_trainable(policy.model, settings)
    if t.init_adapter is not None:
        adapter_files(t.init_adapter)
        check_base(t.init_adapter, base)
        load_adapter_weights(model, t.init_adapter)
        progress(f"LoRA adapters start from {t.init_adapter}")
    policy.model = model  # the model that samples is the model that learns
    policy.max_batch = t.max_batch
    params = [p for p in model.parameters() if p.requires_grad]
    progress(f"training {sum(p.numel() for p in params):,} of {sum(p.numel() for p in model.parameters()):,} "
             f"parameters ({'LoRA' if t.lora else 'full'}"
             + (f", top {t.train_layers} layers" if t.train_layers else "") + ")")
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, t.adam_beta2))
    reference = make_reference(model, settings)
    loss_config = LossConfig(t.clip_eps, t.kl_coef, settings.policy.temperature, t.scale_advantages)
    # Below this layer nothing trains: sampling records the states entering it, and training
    # runs only the layers above (the states are valid as long as the trunk is frozen).
    layers = causal_lm(model).config.num_hidden_layers
    first_layer = max(0, layers - t.train_layers) if t.train_layers else 0
    policy.frozen_below = first_layer
    source: GroupSource
    if t.source == "api":
        source = ApiSource(
            t.api_url,
            token=t.api_token,
            batch_size=t.batch_size or t.deals_per_step * settings.groups.group_size,
            max_token_len=settings.episode.max_token_length,
            steps=t.steps,
            checkpoint_dir=str(out / "checkpoints"),
            save_every=t.save_every,
            timeout_s=t.batch_timeout,
        )
    else:
        source = LocalSource(player, settings.groups, t.deals_per_step, settings.seed)
    _warn_short_answers(player, progress)

    start = 1
    if t.resume is not None:
        state = load_trainer_state(t.resume)
        if (Path(t.resume) / CONFIG).is_file():  # a LoRA checkpoint: trained over the same base model?
            check_base(t.resume, base)
        if state.get("base_adapter") != _adapter_id(t.base_adapter):
            raise ValueError(f"{t.resume} was trained over another --base-adapter (or none): resume with the "
                             "--base-adapter it was trained over")
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state["parameters"].items():
                if name not in named:
                    raise ValueError(f"{t.resume} does not fit this model: it has no parameter {name}; "
                                     "resume with the same --model-path, --lora and --train-layers")
                named[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        if state.get("deals") is not None and isinstance(source, LocalSource):
            source.set_state(state["deals"])
        torch.set_rng_state(state["torch_rng"])
        start = int(state["step"]) + 1
        progress(f"resumed from {t.resume} at step {start}")

    def trainer_state(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "deals": source.get_state() if isinstance(source, LocalSource) else None,
            "torch_rng": torch.get_rng_state(),
            "base_adapter": _adapter_id(t.base_adapter),
        }

    result = TrainResult(out, start - 1)
    log_path = out / "train_log.jsonl"
    best_gap: list[float] = []
    with log_path.open("a" if t.resume is not None else "w", encoding="utf-8") as log:

        def write(row: dict[str, Any]) -> None:
            log.write(json.dumps(row) + "\n")
            log.flush()

        def evaluate(step: int) -> None:
            if t.eval_episodes <= 0:
                return
            row = evaluate_policy(player, settings, step, out)
            result.evals.append(row)
            write(row)
            progress(_eval_line(row))

        def grid(step: int) -> dict[str, Any]:
            row = grid_metrics(player, settings)
            gap = row["grid_hit_gap"]
            if best_gap and best_gap[0] - gap > COLLAPSE_DROP:
                row["collapse_alarm"] = True
                progress(f"warning: step {step}: P(hit) on hit-optimal cells minus on stick-optimal cells fell from "
                         f"{best_gap[0]:.2f} to {gap:.2f}: the policy is drifting toward one constant action")
            best_gap[:] = [max(best_gap[0], gap) if best_gap else gap]
            return row

        if start == 1:
            evaluate(0)
            if t.grid_every:
                row0 = {"kind": "grid", "step": 0, **grid(0)}
                write(row0)
                progress(_grid_line(row0))
        started = time.monotonic()
        measuring = 0.0  # seconds spent on charts and evaluations, which are not training
        try:
            for step in range(start, t.steps + 1):
                t0 = time.perf_counter()
                tokens0, seconds0 = policy.sampled_tokens, policy.sampling_seconds
                policy.record_layer = first_layer or None
                try:
                    groups, info = source.next_groups()
                finally:
                    policy.record_layer = None
                row: dict[str, Any] = {"kind": "step", "step": step, **batch_metrics(groups), **info}
                sampled = policy.sampled_tokens - tokens0
                spent = policy.sampling_seconds - seconds0
                row["sampled_tokens"] = sampled
                row["sample_tokens_per_s"] = sampled / spent if spent > 0 else None
                for param_group in optimizer.param_groups:
                    param_group["lr"] = learning_rate(step, t.lr, t.warmup_steps)
                row["lr"] = optimizer.param_groups[0]["lr"]
                row.update(optimize(model, optimizer, params, groups, loss_config, settings, reference,
                                    first_layer, policy.states))
                policy.states.clear()
                row["seconds"] = time.perf_counter() - t0
                row["elapsed"] = time.monotonic() - started - measuring  # training time: --max-minutes counts it
                if t.grid_every and step % t.grid_every == 0:
                    g0 = time.monotonic()
                    row.update(grid(step))
                    row["grid_seconds"] = time.monotonic() - g0
                    measuring += row["grid_seconds"]
                write(row)
                progress(_line(row, t.steps))
                if "grid_accuracy" in row:
                    progress(_grid_line(row))
                result.steps = step
                last = step == t.steps
                out_of_time = t.max_minutes is not None and row["elapsed"] > 60 * t.max_minutes
                if t.save_every and step % t.save_every == 0:
                    checkpoint(model, policy, out / "checkpoints" / f"step_{step:04d}", trainer_state(step),
                               t.base_adapter, base)
                if out_of_time:
                    result.stopped = "time"
                    progress(f"stopping after {row['elapsed'] / 60:.1f} min (--max-minutes {t.max_minutes})")
                    break
                if t.eval_every and step % t.eval_every == 0 and not last:
                    e0 = time.monotonic()
                    evaluate(step)
                    measuring += time.monotonic() - e0
        finally:
            source.close()
        evaluate(result.steps)
    if hasattr(model, "peft_config"):  # first: the small file a run is kept for
        result.adapter_dir = save_adapter(model, policy.tokenizer, out / "adapter", base, t.base_adapter)
    result.model_dir = export_model(model, policy.tokenizer, out / "model")
    result.plot = plot_log(
        log_path,
        out / "curves.png",
        f"GRPO on {policy.name}, T={settings.policy.temperature}, "
        f"{settings.groups.group_by} groups of {settings.groups.group_size}, lr {t.lr}",
    )
    return result
