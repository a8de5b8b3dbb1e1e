"""`blackjack-rl train`: flags and handler. Imports no torch, so `--help` works without it."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from rich.console import Console

# flag dest -> TrainConfig field (dests carry a prefix so they never meet other sections' flags)
_TRAIN_FLAGS = (
    "source", "steps", "deals_per_step", "lr", "weight_decay", "max_grad_norm", "clip_eps", "kl_coef",
    "scale_advantages", "updates_per_batch", "lora", "lora_rank", "lora_alpha", "train_layers", "max_batch",
    "eval_every", "eval_episodes", "save_every", "grid_every", "resume", "max_minutes", "api_url", "api_token", "batch_size", "batch_timeout",
)


def add_train_parser(sub: Any, add_play: Callable[..., None]) -> None:
    p = sub.add_parser(
        "train",
        help="GRPO-train the model (torch, CPU is enough) and measure it on the evaluation deals",
        description="Train SmolLM2-135M-Instruct (or --model-path: a GGUF or a folder saved by train) with GRPO. "
        "Groups are played by the model being trained (--source local) or pulled from the trajectory API "
        "(--source api, fed by `blackjack-rl serve`). Writes OUT/train_log.jsonl, OUT/curves.png, "
        "OUT/eval/, OUT/model/ (safetensors + tokenizer: evaluate it with --policy hf --model-path OUT/model). "
        "Needs the train extra: pip install 'blackjack-rl[train]'.",
    )
    add_play(p, adapter=False)
    g = p.add_argument_group("groups")
    g.add_argument("--group-size", type=int, help="answers per group (default 16)")
    g.add_argument("--group-by", choices=["episode", "step"],
                   help="episode: whole episodes on one deal (default); step: one group per decision, scored by Q*")
    g.add_argument("--continue-with", choices=["sampled", "best"],
                   help="step groups: which answer the canonical episode continues with (default sampled)")
    g.add_argument("--drop-equal-scores", action="store_true", default=None,
                   help="drop groups whose scores are all equal (they are never trained on anyway)")
    g.add_argument("--token-advantages", action="store_true", default=None,
                   help="per-token credit: format tokens carry validity, the action token the decision's Q*")
    g.add_argument("--counterfactual", action="store_true", default=None,
                   help="step groups: add both valid calls, forced, scored by Q* (the exact decision gradient)")
    g = p.add_argument_group("training")

    def a(flag: str, dest: str, **kw: Any) -> None:
        if "action" not in kw and "choices" not in kw:
            kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        g.add_argument(flag, dest=dest, **kw)

    a("--source", dest="train_source", choices=["local", "api"],
      help="local: play groups with the model being trained (default); api: pull batches from the trajectory API "
           "(the answers are then sampled by whatever model `serve` runs)")
    a("--steps", dest="train_steps", type=int, help="optimizer steps (default 50)")
    a("--deals-per-step", dest="train_deals_per_step", type=int, help="local: deals per step (default 4)")
    a("--lr", dest="train_lr", type=float, help="AdamW learning rate (default 1e-5)")
    a("--weight-decay", dest="train_weight_decay", type=float, help="AdamW weight decay (default 0)")
    a("--max-grad-norm", dest="train_max_grad_norm", type=float, help="gradient clipping (default 1.0)")
    a("--clip-eps", dest="train_clip_eps", type=float, help="PPO ratio clip (default 0.2)")
    a("--kl-coef", dest="train_kl_coef", type=float, help="KL to the initial model (default 0: none)")
    a("--no-scale-advantages", dest="train_scale_advantages", action="store_false", default=None,
      help="do not divide advantages by the group's std (Dr. GRPO)")
    a("--updates-per-batch", dest="train_updates_per_batch", type=int, help="optimizer steps per batch (default 1)")
    a("--lora", dest="train_lora", action="store_true", default=None, help="train LoRA adapters (peft)")
    a("--lora-rank", dest="train_lora_rank", type=int, help="default 16")
    a("--lora-alpha", dest="train_lora_alpha", type=float, help="default 32")
    a("--train-layers", dest="train_train_layers", type=int, help="train only the top N decoder layers")
    a("--max-batch", dest="train_max_batch", type=int, help="answers sampled in one batch (default 64)")
    a("--eval-every", dest="train_eval_every", type=int, help="evaluate every N steps (default 10; 0: before/after)")
    a("--eval-episodes", dest="train_eval_episodes", type=int, help="fixed evaluation deals (default 200; 0: none)")
    a("--save-every", dest="train_save_every", type=int, help="checkpoint every N steps (default 0: final only)")
    a("--grid-every", dest="train_grid_every", type=int,
      help="exact strategy-chart evaluation (no sampling) every N steps (default 1; 0: with the evaluations only)")
    a("--resume", dest="train_resume", metavar="CHECKPOINT",
      help="continue from a checkpoint folder written by --save-every (weights, optimizer state, step, deals)")
    a("--max-minutes", dest="train_max_minutes", type=float, help="stop training after this long, then evaluate")
    a("--api-url", dest="train_api_url", help="api: the trajectory API (default http://127.0.0.1:8000)")
    a("--api-token", dest="train_api_token", help="api: bearer token (or BLACKJACK_RL_TRAIN__API_TOKEN)")
    a("--batch-size", dest="train_batch_size", type=int,
      help="api: sequences per batch (default deals-per-step x group-size)")
    a("--batch-timeout", dest="train_batch_timeout", type=float, help="api: seconds to wait for a batch (default 600)")


def train_settings(args: argparse.Namespace, settings_from_args: Callable[[argparse.Namespace], Any]) -> Any:
    from ..config import TrainConfig

    settings = settings_from_args(args)
    if settings.policy.kind not in ("embedded", "hf"):
        raise ValueError("train samples with its own torch model: drop --policy (use --model-path for another model)")
    train = settings.train.model_dump()
    for name in _TRAIN_FLAGS:
        value = getattr(args, f"train_{name}", None)
        if value is not None:
            train[name] = value
    return settings.model_copy(update={
        "train": TrainConfig.model_validate(train),
        "policy": settings.policy.model_copy(update={"kind": "hf"}),
    })


def cmd_train(args: argparse.Namespace, console: Console, settings_from_args: Callable, argv: list[str]) -> int:
    settings = train_settings(args, settings_from_args)
    from ..players import build_player
    from .loop import run_training

    player = build_player(settings)
    result = run_training(settings, player, argv, progress=lambda line: print(line, flush=True))
    if len(result.evals) >= 2:
        before, after = result.evals[0]["summary"], result.evals[-1]["summary"]
        for key, label in (("valid_decisions", "valid answers"), ("win", "win rate"),
                           ("decision_accuracy", "decision accuracy")):
            b, a = before[key], after[key]
            console.print(f"{label:>18}: {100 * b['rate']:5.1f}% [{100 * b['ci95_low']:.1f}, {100 * b['ci95_high']:.1f}]"
                          f" -> {100 * a['rate']:5.1f}% [{100 * a['ci95_low']:.1f}, {100 * a['ci95_high']:.1f}]")
    console.print(f"Model in [bold]{result.model_dir}[/bold] (evaluate: blackjack-rl evaluate --policy hf "
                  f"--model-path {result.model_dir}); log {result.out}/train_log.jsonl; curves [bold]{result.plot}[/bold]")
    return 0
