"""The command line: `blackjack-rl solve | process | evaluate | grid | compare | fidelity | serve | train | api`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
from typing import TYPE_CHECKING

from blackjack_rl.cli_options import Option, Parser, add_options, given, options_of, select, subcommands, validation_error
from blackjack_rl.cluster import ClusterError
from blackjack_rl.train.cli import TRAIN_SETTINGS, refusal

if TYPE_CHECKING:
    from rich.console import Console

# Heavy libraries (FastAPI, httpx, pydantic, transformers, torch, llama_cpp) are imported
# by the handlers that use them, so `--help` and `solve` start fast (tests/test_startup.py).


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are a user's error, shown as one line. Evaluated only when one is
    raised: the API client's errors can only exist if a handler imported that client."""
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError, sqlite3.Error, ClusterError)
    client = sys.modules.get("blackjack_rl.api.client")
    if client is not None:
        errors += (client.ApiRejected, client.ApiUnavailable)
    return errors

# What each command lets the command line set: a name is one settings field, or a section with
# all its fields (cli_options.select). Flags, choices, help and defaults come from config.py;
# what a command does not expose comes from --config, the environment or the defaults.
# `--seed` deals process's and serve's groups; evaluate plays the fixed evaluation deals and grid
# reads probabilities, so neither takes it, nor does grid take --concurrency.
PLAY = ("out", "policy", "episode", "game")
CONCURRENCY = ("groups.concurrency", "evaluate.concurrency")
SHARDS = ("ray.address", "ray.actors", "ray.cpus")
SETTINGS: dict[str, tuple[str, ...]] = {
    "solve": ("game.natural", "game.sab"),
    "process": (*PLAY, "seed", *CONCURRENCY, "process", "groups", *SHARDS),
    "evaluate": (*PLAY, *CONCURRENCY, "evaluate", *SHARDS),
    "grid": (*PLAY, "evaluate.game_budget"),
    "serve": (*PLAY, "seed", *CONCURRENCY, "groups", "serve", "ray.address", "ray.workers", "ray.cpus",
              "ray.max_restarts"),
    "train": TRAIN_SETTINGS,
    "fidelity": ("out", "policy", "episode.invalid_score", "episode.max_token_length", "game"),
}
# balancing decisions weighs the trainer's batches, and a continuation snapshot lasts training steps:
# process and serve have neither
_TRAIN_ONLY = ("groups.balance_actions", "groups.balance_by", "groups.balance_later", "groups.rollout_refresh")
# The chart and the whole game read the two calls' probabilities at temperature alone (no truncation)
# and score an invalid answer as a forfeit, with no format bonus or re-prompt (measure/probe.py)
_TRUNCATION = ("policy.top_p", "policy.top_k", "policy.min_p")
_NOT_IN_THE_CHART = (*_TRUNCATION, "episode.scoring", "episode.format_bonus", "episode.invalid_retries")
WITHOUT: dict[str, tuple[str, ...]] = {"process": _TRAIN_ONLY, "serve": _TRAIN_ONLY, "grid": _NOT_IN_THE_CHART,
                                       "fidelity": _TRUNCATION}


def _add_settings(p: argparse.ArgumentParser, command: str) -> None:
    from blackjack_rl.config import Settings

    add_options(p, select(Settings, SETTINGS[command], WITHOUT.get(command, ())))


def _add_common(p: argparse.ArgumentParser) -> None:
    """Flags of every command that plays, which are no settings."""
    p.add_argument("--config", metavar="FILE", help="YAML settings file (flags and BLACKJACK_RL_* env vars override it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="blackjack-rl",
        description="Train and evaluate LLM agents on Blackjack with reinforcement learning.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("solve", help="exact optimal policy and its value",
                       description="Solve the chosen rules exactly: expected return, outcome odds, strategy chart.")
    _add_settings(p, "solve")
    p.add_argument("--json", action="store_true", help="machine-readable output, with every Q*(s, a)")

    p = sub.add_parser("process", help="play groups and write an Atropos dataset (JSONL + HTML)",
                       description="Play N groups (all episodes of a group share one deal) and write "
                                   "OUT/groups.jsonl, one Atropos ScoredDataGroup a line, and OUT/groups.html.")
    _add_common(p)
    _add_settings(p, "process")

    p = sub.add_parser("evaluate", help="play the fixed evaluation deals and report metrics",
                       description="Play the fixed evaluation seeds and write OUT/metrics.json and OUT/samples.jsonl.")
    _add_common(p)
    _add_settings(p, "evaluate")

    p = sub.add_parser("serve", help="feed the trajectory API as an environment worker",
                       description="Register with the trajectory API, then play groups and send them, keeping "
                                   "max_batches_offpolicy x batch_size sequences ahead of the trainer. Groups the "
                                   "API cannot take are parked in OUT/outbox.sqlite and sent when it returns. "
                                   "Metrics go to OUT/serve_metrics.jsonl. SIGTERM drains, flushes and disconnects.")
    _add_common(p)
    _add_settings(p, "serve")
    p.add_argument("--wandb-project", help="also log metrics to Weights & Biases (pip install 'blackjack-rl[wandb]')")

    p = sub.add_parser("grid", help="exact strategy chart of a policy, from its probabilities (no sampling)",
                       description="Read the policy's P(hit) among its valid calls in each of the 280 chart states "
                                   "(hard 4-21, soft 12-21, dealer A-10) from its logprobs of the two calls, then "
                                   "compute exactly the expected return of that policy, its decision accuracy "
                                   "weighted by its own visits, and its regret. Writes OUT/grid.json and OUT/grid.html.")
    _add_common(p)
    _add_settings(p, "grid")

    p = sub.add_parser("compare", help="compare evaluation runs deal by deal",
                       description="Compare evaluation runs (folders written by `evaluate`) against the first one. "
                                   "All runs play the same fixed deals, so differences are paired by seed, with 95% "
                                   "confidence intervals. Prints a table and writes OUT/compare.html and OUT/compare.json.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="evaluation folders; the first is the baseline")
    p.add_argument("--out", metavar="DIR", default="runs/compare", help="where to write the page (default runs/compare)")

    p = sub.add_parser("fidelity", help="score a groups file's credit against the policy's exact advantages",
                       description="Read the credit each action of GROUPS got (per-token advantages on the action "
                                   "word, or GRPO's scalar advantage) and score it against A^pi(h, a) = Q^pi(h, a) - "
                                   "V^pi(h) of the policy given here (the one that sampled the groups), computed "
                                   "exactly from its probabilities over the game tree: sign agreement, correlation, "
                                   "bias and noise. Writes OUT/fidelity.json.")
    _add_common(p)
    _add_settings(p, "fidelity")
    p.add_argument("groups", metavar="GROUPS", help="a groups file (JSONL, one Atropos ScoredDataGroup a line) whose "
                                                    "groups carry our records: written by process, serve or train")
    p.add_argument("--max-decisions", type=_bounded_int(1, 100_000), default=2_000, metavar="N",
                   help="score at most the first N decisions (default 2000)")
    p.add_argument("--tree-budget", type=_bounded_int(1, 1_000_000), default=1_000, metavar="N",
                   help="histories scored below each hit for Q^pi(h, hit) (default 1000)")

    from blackjack_rl.train.cli import add_train_parser

    p = add_train_parser(sub)
    _add_common(p)
    _add_settings(p, "train")

    sub.add_parser("api", help="run the trajectory API (Atropos-compatible)", add_help=False,
                   description="Run the trajectory API; see `blackjack-rl api --help`.")
    return parser


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


def settings_from_args(args: argparse.Namespace):
    """The settings: the flags given, over the environment, the --config file and the defaults."""
    from blackjack_rl.config import load_settings

    return load_settings(getattr(args, "config", None), given(args))


def _cmd_solve(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.report.console import print_solution, solution_json
    from blackjack_rl.game.solver import solve

    solution = solve(settings_from_args(args).game.rules)
    if args.json:
        print(json.dumps(solution_json(solution), indent=2))
    else:
        print_solution(solution, console)
    return 0


def _shards(settings):
    """With --ray: the shard scheduler on that cluster (cluster.shards); else None, play here."""
    import contextlib

    r = settings.ray
    if r.address is None:
        return contextlib.nullcontext()
    from blackjack_rl.cluster.shards import shards_for

    return shards_for(r.address, settings, r.actors, r.cpus)


def _cmd_process(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.jobs.process import run_process
    from blackjack_rl.rollout.players import run_with_player

    settings = settings_from_args(args)
    with _shards(settings) as shards:
        s = run_with_player(settings, lambda player: run_process(settings, player, progress=not args.quiet,
                                                                  deals=shards and shards.deals))
    t = s.tally
    console.print(
        f"Wrote {s.groups_written} groups ({t.sequences} sequences from {t.episodes} episodes, "
        f"{t.episodes_failed} failed" + (f", dropped {t.groups_dropped}" if t.groups_dropped else "")
        + f") in {s.seconds:.1f}s to [bold]{s.out_file}[/bold]; browse them in [bold]{s.html_file}[/bold]"
    )
    return 0 if t.episodes_failed == 0 else 3


def _cmd_evaluate(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.report.console import print_metrics

    settings = settings_from_args(args)
    if settings.evaluate.game_budget is not None and not settings.evaluate.grid:
        raise ValueError("--game-budget sizes the whole game that --grid reads after the chart: add --grid")
    if settings.evaluate.versus_base:
        if not settings.evaluate.samples:  # refused before minutes of play, not by compare after them
            raise ValueError("--versus-base pairs the two runs deal by deal from their samples.jsonl: drop --no-samples")
        return _versus_base(settings, args, console)
    metrics = _evaluate(settings, args)
    print_metrics(metrics, console)
    console.print(f"Metrics in [bold]{settings.out}/metrics.json[/bold]"
                  + (f", every episode in [bold]{settings.out}/samples.jsonl[/bold]" if settings.evaluate.samples else "")
                  + f"; the report is [bold]{settings.out}/report.html[/bold]")
    return 0 if metrics.episodes_failed == 0 else 3


def _evaluate(settings, args: argparse.Namespace):
    from blackjack_rl.jobs.evaluate import evaluate_settings

    with _shards(settings) as shards:
        return evaluate_settings(settings, progress=not args.quiet, play=shards and shards.evaluate)


def _versus_base(settings, args: argparse.Namespace, console: Console) -> int:
    """The adapter and its base model on the same fixed deals, live, then paired deal by deal."""
    from pathlib import Path

    from blackjack_rl.jobs.compare import run_versus
    from blackjack_rl.report.console import print_comparison

    if not settings.policy.lora:
        raise ValueError("--versus-base compares a model with an adapter against the model alone: add --lora "
                         "NAME_OR_PATH (e.g. --lora three-phase)")
    out = Path(settings.out)
    base = settings.model_copy(update={"out": out / "base", "policy": settings.policy.model_copy(update={"lora": None, "lora_fold": None})})
    adapter = settings.model_copy(update={"out": out / "adapter"})
    failed = []
    compared = run_versus([base, adapter], out, lambda s: failed.append(_evaluate(s, args).episodes_failed))
    print_comparison(compared.runs, compared.comparisons, console)
    console.print(f"Each run in [bold]{out}/base[/bold] and [bold]{out}/adapter[/bold] (metrics.json, report.html); "
                  f"side by side in [bold]{compared.page}[/bold]")
    return 0 if not any(failed) else 3


def _cmd_grid(args: argparse.Namespace, console: Console) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from rich.markup import escape

    from blackjack_rl.jobs.grid import run_grid
    from blackjack_rl.rollout.players import run_with_player
    from blackjack_rl.report.console import game_line, gap_line

    settings = settings_from_args(args)
    run = run_with_player(settings, lambda player: run_grid(Path(settings.out), player,
                                                             game_budget=settings.evaluate.game_budget))
    g = run.grid
    console.print(f"exact value {g.value:+.4f} (optimal {g.optimal_value:+.4f}, regret {g.regret:.4f}); "
                  f"accuracy {100 * g.accuracy:.1f}% by visits, {100 * g.cell_accuracy:.1f}% by cell; "
                  f"P(hit) {g.p_hit_hit_optimal:.2f} where hit is optimal, {g.p_hit_stick_optimal:.2f} where stick is "
                  f"({run.seconds:.1f}s).")
    console.print(gap_line([asdict(b) for b in g.by_gap]), highlight=False)
    if run.game is not None:
        console.print(escape(game_line(run.game)))
    console.print(f"Chart in [bold]{run.page}[/bold]")
    return 0


def _cmd_fidelity(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from blackjack_rl.jobs.fidelity import run_fidelity
    from blackjack_rl.rollout.players import run_with_player
    from blackjack_rl.report.console import print_fidelity

    settings = settings_from_args(args)
    groups = Path(args.groups)
    if not groups.is_file():
        raise ValueError(f"{groups}: no such groups file")
    run = run_with_player(settings, lambda player: run_fidelity(groups, player, Path(settings.out),
                                                                 max_decisions=args.max_decisions,
                                                                 budget=args.tree_budget))
    print_fidelity(run, console)
    return 0


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.jobs.compare import run_compare
    from blackjack_rl.report.console import print_comparison

    run = run_compare(args.runs, args.out)
    print_comparison(run.runs, run.comparisons, console)
    console.print(f"Side by side in [bold]{run.page}[/bold]")
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.jobs.serve import serve
    from blackjack_rl.rollout.players import run_with_player

    settings = settings_from_args(args)
    if settings.ray.address is not None:
        return _serve_on_ray(settings, args, console)
    if "workers" in given(args).get("ray", {}):
        raise ValueError("--workers starts worker actors on Ray: add --ray [ADDRESS]")
    wandb_run = None
    if args.wandb_project:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError("--wandb-project needs wandb: pip install 'blackjack-rl[wandb]'") from exc
        wandb_run = wandb.init(project=args.wandb_project, config=settings.model_dump(mode="json"))
    logging.getLogger("blackjack_rl").setLevel(logging.INFO)
    stats = run_with_player(settings, lambda player: serve(settings, player, wandb_run))
    console.print(f"Sent {stats.groups_sent} groups ({stats.groups_parked} parked in {settings.out}/outbox.sqlite, "
                  f"{stats.groups_rejected} refused, dropped {stats.groups_dropped or 0}); "
                  f"{stats.episodes} episodes, {stats.episodes_failed} failed. Log: {settings.out}/serve_metrics.jsonl")
    return 0 if stats.groups_rejected == 0 else 3


def _serve_on_ray(settings, args: argparse.Namespace, console: Console) -> int:
    if args.wandb_project:
        raise ValueError("--wandb-project is for one worker; with --ray, each worker logs to OUT/<worker id>/")
    from blackjack_rl.cluster.workers import serve_on_ray

    logging.getLogger("blackjack_rl").setLevel(logging.INFO)
    result = serve_on_ray(settings)
    t = result.totals
    console.print(f"{result.workers} workers ({result.restarts} restarts) sent {t.groups_sent} groups "
                  f"({t.groups_parked} parked, {t.groups_rejected} refused, dropped {t.groups_dropped or 0}); "
                  f"{t.episodes} episodes, {t.episodes_failed} failed. Logs: {settings.out}/<worker id>/serve_metrics.jsonl")
    return 0 if t.groups_rejected == 0 else 3


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from blackjack_rl.train.cli import cmd_train

    if args.recipe is not None and args.config is not None:
        raise ValueError("--config: a recipe holds every setting of its phases; pass a recipe file to --recipe instead")
    return cmd_train(settings_from_args(args), console, sys.argv[1:], given(args), recipe=args.recipe,
                     dry_run=args.dry_run, quiet=args.quiet)


def _unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """Why a flag is not this command's: the reason train gives, or the commands that take it."""
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")]
    for flag in flags:
        reason = refusal(flag) if command == "train" else None
        if reason:
            return reason
        others = [name for name, sub in subcommands(parser).items()
                  if name != command and flag in sub._option_string_actions]
        if others:
            return f"{flag} is an option of {', '.join(others)}, not of {command}"
    return f"unrecognized arguments: {' '.join(unknown)}"


def user_error(exc: BaseException, options: tuple[Option, ...] = ()) -> str:
    """A user error in one line: each bad setting by its flag where the command has one, and what is wrong."""
    pydantic = sys.modules.get("pydantic")  # loaded by whatever raised a ValidationError
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        return validation_error(exc, options)
    settings_errors = sys.modules.get("pydantic_settings")
    if settings_errors is not None and isinstance(exc, settings_errors.SettingsError):  # environment variables only
        return (f"{exc}: an environment variable for a list or mapping setting holds JSON, "
                """e.g. BLACKJACK_RL_API_CORS_ORIGINS='["https://example.org"]'""")
    if isinstance(exc, sqlite3.OperationalError):  # cannot open, locked, read-only
        return f"database error: {exc}"
    if isinstance(exc, sqlite3.DatabaseError):
        return f"database error: {exc} (is it a blackjack-rl database, and not damaged?)"
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torch's CPU allocator (c10, read before its first allocation) backs large tensors with
    # transparent huge pages: the vocabulary head's [rows, 49,152] buffers otherwise fault in a
    # 4 KB page at a time on every batch. A value the user set wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    options: tuple[Option, ...] = ()
    try:
        if argv[:1] == ["api"]:
            from blackjack_rl.api.cli import main as api_main

            return api_main(argv[1:])
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # named by the subcommand, whose --help lists what it takes
            subcommands(parser)[args.command].error(_unknown(parser, args.command, unknown))
        options = options_of(args)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        from rich.console import Console

        console = Console(stderr=False)
        handlers = {"solve": _cmd_solve, "process": _cmd_process, "evaluate": _cmd_evaluate, "serve": _cmd_serve,
                    "compare": _cmd_compare, "train": _cmd_train, "grid": _cmd_grid, "fidelity": _cmd_fidelity}
        return handlers[args.command](args, console)
    except _user_errors() as exc:  # ValidationError is a ValueError
        # plain print: rich would wrap a long message over several lines and read [..] as markup
        print(f"error: {user_error(exc, options)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
