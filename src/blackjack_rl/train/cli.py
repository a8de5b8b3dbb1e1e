"""`blackjack-rl train`: flags and handler. Imports no torch, so `--help` works without it."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console


def add_train_parser(sub: Any) -> argparse.ArgumentParser:
    """The `train` subcommand; its flags are the settings cli.py derives from config.TrainConfig and the
    sections a play command has."""
    return sub.add_parser(
        "train",
        help="GRPO-train the model (torch, CPU is enough) and measure it on the evaluation deals",
        description="Train SmolLM2-135M-Instruct (or --model-path: a GGUF or a folder saved by train) with GRPO. "
        "Groups are played by the model being trained (--source local) or pulled from the trajectory API "
        "(--source api, fed by `blackjack-rl serve`). Writes OUT/train_log.jsonl, OUT/curves.png, "
        "OUT/eval/, OUT/model/ (safetensors + tokenizer: evaluate it with --policy hf --model-path OUT/model). "
        "Needs the train extra: pip install 'blackjack-rl[train]'.",
    )


def train_settings(settings: Any) -> Any:
    """The settings for training: always the torch policy, which samples with the model it trains."""
    if settings.policy.kind not in ("embedded", "hf"):
        raise ValueError("train samples with its own torch model: drop --policy (use --model-path for another model)")
    return settings.model_copy(update={"policy": settings.policy.model_copy(update={"kind": "hf"})})


def cmd_train(settings: Any, console: Console, argv: list[str]) -> int:
    settings = train_settings(settings)
    from blackjack_rl.rollout.players import build_player
    from blackjack_rl.train.trainer import run_training

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
