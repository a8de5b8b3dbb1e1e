"""`blackjack-rl train`: flags and handler. Imports no torch, so `--help` works without it.

`train` takes only the options that act on training. The policy options that pick or reach
another player (servers, bots, llama.cpp) are not its flags at all, and `refusal` says why
when one is given; options that act only with another option (`--api-url` with `--source
api`, `--lora-rank` with `--lora`) are refused without it. With `--recipe` the recipe sets
everything but the run's seed, output folder and threads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# The policy fields that act on training: the torch model and how it samples.
TRAIN_POLICY = ("model_path", "temperature", "top_p", "top_k", "min_p", "max_tokens", "n_threads", "max_batch")
# What `train` lets the command line set (cli_options.select names)
TRAIN_SETTINGS = ("seed", "out", *(f"policy.{name}" for name in TRAIN_POLICY), "episode", "game", "groups",
                  "evaluate.concurrency", "train")

_SERVER = ("train samples with the torch model it trains, never with an inference server (to train on groups a "
           "served model plays, run `blackjack-rl serve` and `train --source api`)")
REFUSED = {
    "--policy": "train always samples with the torch model it trains: pass another model with --model-path",
    "--constrained": "constrained decoding changes the sampled distribution, so training never samples with it",
    "--threshold": "it sets the threshold bot, which does not train",
    "--n-ctx": "it sizes llama.cpp's context, and train runs the model in torch",
    "--lora-fold": "it folds an adapter into the llama.cpp model that plays, and train runs the model in torch",
    **{flag: _SERVER for flag in ("--base-url", "--model", "--api-key", "--tokenizer", "--timeout", "--retries",
                                  "--native-tools", "--structured-output", "--server", "--server-api", "--token-path",
                                  "--server-concurrency", "--no-sticky")},
}

# train fields that act only beside another option
_API_ONLY = ("api_url", "api_token", "batch_size", "batch_timeout")
_LORA_ONLY = ("lora_rank", "lora_alpha")
# With --recipe, the command line may set only these; the recipe sets the rest.
RECIPE_GIVEN = {("seed",), ("out",), ("policy", "n_threads")}


def add_train_parser(sub: Any) -> argparse.ArgumentParser:
    """The `train` subcommand; its settings flags are added by cli.py from TRAIN_SETTINGS."""
    p = sub.add_parser(
        "train",
        help="GRPO-train the model (torch, CPU is enough) and measure it on the evaluation deals",
        description="Train SmolLM2-135M-Instruct (or --model-path: a GGUF or a folder saved by train) with GRPO. "
        "`--recipe NAME_OR_FILE` runs a recipe's phases in order, each from the previous one's adapter, and "
        "ends with the starting and the trained model on the same fixed deals, paired (`--dry-run` prints its "
        "phases; `--resume OUT` continues a killed run). Without a recipe, groups are played by the model being "
        "trained (--source local) or pulled from the trajectory API (--source api, fed by `blackjack-rl serve`). "
        "Writes OUT/train_log.jsonl, OUT/curves.png, OUT/eval/, OUT/model/ (evaluate it with --policy hf "
        "--model-path OUT/model). Needs the train extra: pip install 'blackjack-rl[train]'.",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE",
                   help="run a recipe: a shipped one by name (three-phase) or a recipe file (.yaml)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the phases and their effective settings (or the run's settings), and train nothing")
    return p


def refusal(flag: str) -> str | None:
    """Why `train` has no such option, where it is another command's."""
    reason = REFUSED.get(flag)
    return f"{flag} is not an option of train: {reason}" if reason else None


def check_given(given: dict[str, Any], settings: Any) -> None:
    """Refuse, in one line, an option given that does nothing with the others."""
    t = given.get("train", {})
    if settings.train.source == "local":
        for name in _API_ONLY:
            if name in t:
                raise ValueError(f"--{name.replace('_', '-')} is for groups pulled from the API: add --source api")
    if "fidelity_probes" in t:
        if not settings.train.fidelity_every:
            raise ValueError("--fidelity-probes sizes the probe of --fidelity-every: add --fidelity-every N")
        if settings.train.source == "api":
            raise ValueError("--fidelity-probes: with --source api, fidelity scores the pulled batch itself, "
                             "not probe deals")
    if not settings.train.lora:
        for name in _LORA_ONLY:
            if name in t:
                raise ValueError(f"--{name.replace('_', '-')} shapes LoRA adapters: add --lora")


def train_settings(settings: Any) -> Any:
    """The settings for training: always the torch policy, which samples with the model it trains."""
    if settings.policy.kind not in ("embedded", "hf"):
        raise ValueError("train samples with its own torch model: drop --policy (use --model-path for another model)")
    return settings.model_copy(update={"policy": settings.policy.model_copy(update={"kind": "hf"})})


def cmd_train(settings: Any, console: Console, argv: list[str], given: dict[str, Any], *, recipe: str | None,
              dry_run: bool, quiet: bool) -> int:
    resume = settings.train.resume
    from blackjack_rl.train.pipeline import is_recipe_run

    if recipe is not None or (resume is not None and is_recipe_run(Path(resume))):
        return _cmd_recipe(settings, console, argv, given, recipe, dry_run, quiet)
    check_given(given, settings)
    settings = train_settings(settings)
    if dry_run:
        from blackjack_rl.train.recipe import effective

        console.print_json(json.dumps(effective(settings)))
        return 0
    from blackjack_rl.outputs import prepare_folder
    from blackjack_rl.rollout.players import build_player
    from blackjack_rl.train.trainer import run_training

    if settings.train.resume is not None:
        from blackjack_rl.train.checkpoints import check_resumable

        check_resumable(settings.train.resume)
    prepare_folder(settings.out)
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


def _cmd_recipe(settings: Any, console: Console, argv: list[str], given: dict[str, Any], recipe: str | None,
                dry_run: bool, quiet: bool) -> int:
    """`train --recipe NAME_OR_FILE [--seed N] [--threads N] --out DIR`, or `train --resume DIR`."""
    from blackjack_rl.train import pipeline
    from blackjack_rl.train.recipe import effective, leaf_paths, recipe_text

    resume = settings.train.resume
    allowed = set() if resume is not None else RECIPE_GIVEN
    extra = [path for path in leaf_paths(given) if path not in allowed and path != ("train", "resume")]
    if recipe is not None and resume is not None:
        raise ValueError("a recipe run resumes from its folder alone: blackjack-rl train --resume DIR")
    if extra:
        flag = "--" + extra[0][-1].replace("_", "-")
        raise ValueError(f"{flag}: " + ("a resumed recipe run takes every setting from its folder" if resume is not None
                                        else "the recipe sets it: print it with --dry-run, copy the recipe file, edit "
                                             "it and pass the copy to --recipe (the command line sets only --seed, "
                                             "--threads and --out)"))
    if resume is not None:
        run = pipeline.open_run(Path(resume))
    else:
        text, source = recipe_text(recipe or "")
        seed, threads = settings.seed, settings.policy.n_threads
        if dry_run:
            from blackjack_rl.train.recipe import parse_recipe

            run = pipeline.RecipeRun(Path(settings.out), parse_recipe(text, source), seed, threads)
        else:
            run = pipeline.start_run(text, source, Path(settings.out), seed, threads)
    r = run.recipe
    console.print(f"recipe [bold]{r.name}[/bold] v{r.version}: signal {signal_name(r.signal)}; "
                  f"{len(r.phases)} phases, {sum(p.steps for p in r.phases)} steps; run seed {run.seed}")
    if dry_run:
        for i, phase_settings in enumerate(pipeline.plan(run)):
            phase = r.phases[i]
            rule = f", or until {phase.stop_when.metric} >= {phase.stop_when.at_least}" if phase.stop_when else ""
            console.print(f"phase {i + 1} [bold]{phase.name}[/bold]: {phase.steps} steps{rule}")
            console.print_json(json.dumps(effective(phase_settings)))
        console.print(f"then the report: {r.report.episodes} fixed deals, the starting model and the trained one"
                      + (", with the exact chart" if r.report.grid else ""))
        return 0
    last = pipeline.run_phases(run, ["train", "--recipe", r.name, "--seed", str(run.seed), "--out", str(run.out)],
                               progress=lambda line: print(line, flush=True))
    page = pipeline.report(run, last, quiet, console)
    console.print(f"Trained adapter in [bold]{last}/adapter[/bold]; before and after in [bold]{page}[/bold]")
    return 0


def signal_name(signal: str) -> str:
    return {"solver": "exact decision credit from the solver (Q*)",
            "table": "the table's rewards alone (no solver output)"}[signal]
