"""The command line: `blackjack-rl solve | process | evaluate | api | serve`."""

from __future__ import annotations

import argparse
import json
import logging
import sqlite3
import sys
from typing import TYPE_CHECKING, Any

from .cluster import ClusterError

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

# flag -> (section, field); flags left unset keep YAML / environment / default values
_OVERRIDES: dict[str, tuple[str | None, str]] = {
    "seed": (None, "seed"),
    "out": (None, "out"),
    "policy": ("policy", "kind"),
    "model_path": ("policy", "model_path"),
    "base_url": ("policy", "base_url"),
    "model": ("policy", "model"),
    "api_key": ("policy", "api_key"),
    "tokenizer": ("policy", "tokenizer"),
    "temperature": ("policy", "temperature"),
    "top_p": ("policy", "top_p"),
    "max_tokens": ("policy", "max_tokens"),
    "timeout": ("policy", "timeout"),
    "retries": ("policy", "retries"),
    "native_tools": ("policy", "native_tools"),
    "constrained": ("policy", "constrained"),
    "structured_output": ("policy", "structured_output"),
    "threshold": ("policy", "threshold"),
    "threads": ("policy", "n_threads"),
    "lora": ("policy", "lora"),
    "server": ("policy", "servers"),
    "server_api": ("policy", "server_api"),
    "token_path": ("policy", "token_path"),
    "server_concurrency": ("policy", "max_concurrency_per_server"),
    "sticky": ("policy", "sticky"),
    "natural": ("game", "natural"),
    "sab": ("game", "sab"),
    "max_turns": ("game", "max_turns"),
    "invalid_score": ("episode", "invalid_score"),
    "max_token_length": ("episode", "max_token_length"),
    "groups": ("process", "groups"),
    "group_size": ("groups", "group_size"),
    "drop_equal_scores": ("groups", "drop_equal_scores"),
    "episodes": ("evaluate", "episodes"),
    "scoring": ("episode", "scoring"),
    "format_bonus": ("episode", "format_bonus"),
    "invalid_retries": ("episode", "invalid_retries"),
    "thinking": ("episode", "thinking"),
    "think_budget": ("episode", "think_budget"),
    "group_by": ("groups", "group_by"),
    "continue_with": ("groups", "continue_with"),
    "token_advantages": ("groups", "token_advantages"),
    "counterfactual": ("groups", "counterfactual"),
    "scale_decisions": ("groups", "scale_decisions"),
    "format_weight": ("groups", "format_weight"),
    "api_url": ("serve", "api_url"),
    "api_token": ("serve", "api_token"),
    "env_name": ("serve", "env_name"),
    "worker_id": ("serve", "worker_id"),
    "weight": ("serve", "weight"),
    "min_batch_allocation": ("serve", "min_batch_allocation"),
    "max_batches_offpolicy": ("serve", "max_batches_offpolicy"),
    "steps_per_eval": ("serve", "steps_per_eval"),
    "eval_episodes": ("serve", "eval_episodes"),
    "max_groups": ("serve", "max_groups"),
    "register_timeout": ("serve", "register_timeout"),
    "drain_timeout": ("serve", "drain_timeout"),
    "ray": ("ray", "address"),
    "ray_actors": ("ray", "actors"),
    "ray_cpus": ("ray", "cpus"),
    "workers": ("ray", "workers"),
}


def _add_rules(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rules (Gymnasium Blackjack-v1)")
    g.add_argument("--natural", action="store_true", default=None, help="a natural blackjack pays 1.5")
    g.add_argument("--sab", action="store_true", default=None, help="Sutton & Barto rules (override --natural)")


def _add_play(p: argparse.ArgumentParser, adapter: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML settings file (flags and BLACKJACK_RL_* env vars override it)")
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/latest)")
    p.add_argument("--seed", type=int, help="base seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("policy")
    g.add_argument("--policy", choices=["embedded", "openai", "optimal", "threshold", "random", "hf"],
                   help="who plays (default: embedded SmolLM2-135M-Instruct; hf: a torch model, e.g. one saved "
                        "by `train`, needs the train extra)")
    g.add_argument("--model-path", metavar="PATH",
                   help="another GGUF for the embedded policy; for hf, a GGUF or a model folder saved by `train`")
    g.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", help="model name on the server")
    g.add_argument("--api-key", help="server API key (or BLACKJACK_RL_POLICY__API_KEY)")
    g.add_argument("--tokenizer", help="Hugging Face tokenizer name or folder (or a .gguf) for the trajectory tokens")
    g.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--max-tokens", type=int, help="new tokens per model turn (default 64)")
    g.add_argument("--timeout", type=float, help="seconds per server request (default 60)")
    g.add_argument("--retries", type=int, help="retries on timeouts and 5xx (default 2)")
    g.add_argument("--native-tools", action="store_true", default=None, help="send the tool schema as `tools`")
    g.add_argument("--server", action="append", metavar="URL[,WEIGHT]",
                   help="an inference server of a pool (repeat for more); each conversation stays on one healthy server, "
                        "and conversations spread over the servers by weight")
    g.add_argument("--server-api", choices=["vllm", "sglang", "llamacpp"],
                   help="how the servers take and return token ids (default vllm)")
    g.add_argument("--token-path", choices=["auto", "completions", "chat"],
                   help="token ids via completions, or chat text; auto asks the servers (default with --server)")
    g.add_argument("--server-concurrency", type=int, help="requests in flight per server (default 128)")
    g.add_argument("--no-sticky", dest="sticky", action="store_false", default=None,
                   help="route each request to the least-loaded server; by default an episode's turns and a group's "
                        "answers stay on one server while it is healthy, so its prefix cache hits")
    g.add_argument("--constrained", action="store_true", default=None,
                   help="constrained decoding, every answer a valid call: a token-level constraint to the two valid answers (embedded) or the "
                        "server's structured output (openai, see --structured-output); for play and evaluation")
    g.add_argument("--structured-output",
                   choices=["json_schema", "json_object", "structured_outputs", "guided_json", "tool_choice"],
                   help="how --constrained asks a chat server (default json_schema: OpenAI, vLLM, SGLang, "
                        "llama-server; json_object: llama-cpp-python's server; structured_outputs / guided_json: "
                        "vLLM new / old; tool_choice: a forced tool call)")
    g.add_argument("--threshold", type=int, help="the threshold bot hits below this sum (default 17)")
    if adapter:  # `train --lora` means "train LoRA adapters"
        g.add_argument("--lora", metavar="PATH",
                       help="embedded: apply a LoRA adapter (a GGUF adapter, or a folder saved by `train --lora`; "
                            "e.g. the committed docs/training/adapter)")
    g.add_argument("--threads", type=int, help="llama.cpp threads (default: one per core that other processes "
                                                "leave free, revisited as the load changes)")
    g = p.add_argument_group("episodes")
    g.add_argument("--max-turns", type=int, help="model turns per episode (default 10)")
    g.add_argument("--invalid-score", type=float, help="score of an invalid answer (default -1.0)")
    g.add_argument("--max-token-length", type=int, help="token budget per episode (default 1024)")
    g.add_argument("--concurrency", type=int, help="episodes played at once (default 64)")
    g.add_argument("--scoring", choices=["outcome", "expected"],
                   help="outcome: the game reward (default); expected: V*(s0) minus each decision's regret "
                        "(same mean, far lower variance; both are always recorded)")
    g.add_argument("--format-bonus", type=float, help="bonus for well-formed answers (default 0)")
    g.add_argument("--invalid-retries", type=int,
                   help="re-prompt after an invalid answer, with the reason, up to N times before the episode "
                        "forfeits (default 0: it forfeits at once)")
    g.add_argument("--thinking", action="store_true", default=None,
                   help="the model reasons in <think>...</think> before its call; older thoughts are cut to fit")
    g.add_argument("--think-budget", type=int, help="extra new tokens per turn for reasoning (default 192)")
    _add_rules(p)


def _add_ray(p: argparse.ArgumentParser, serve: bool = False) -> None:
    g = p.add_argument_group("Ray (pip install 'blackjack-rl[ray]'; see docs/cluster.md)")
    g.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run on a Ray cluster: `auto` joins the one `ray start` runs on this node, HOST:PORT another; "
                        "no address starts a local one for this command"
                        + ("" if serve else "; the deals are split into shards, merged in seed order"))
    if serve:
        g.add_argument("--workers", type=int, help="worker actors, worker ids ID-0..ID-(N-1) (default 1); a dead "
                                                   "one is restarted with its id and continues its deals")
    else:
        g.add_argument("--ray-actors", type=int, metavar="N", help="shard actors (default: the cluster's CPUs / --ray-cpus)")
    g.add_argument("--ray-cpus", type=float, metavar="N", help="CPUs per actor, also its model threads (default 1)")


def _add_grouping(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", type=int, help="episodes per group (default 16)")
    p.add_argument("--drop-equal-scores", action="store_true", default=None,
                   help="skip groups whose scores are all equal (no GRPO signal)")
    p.add_argument("--group-by", choices=["episode", "step"],
                   help="episode: whole episodes on one deal (default); step: one group per decision, "
                        "each answer scored by Q*(s, a); each sequence is the shared prompt plus one answer")
    p.add_argument("--continue-with", choices=["sampled", "best"],
                   help="step groups: which answer the canonical episode continues with (default sampled)")
    p.add_argument("--token-advantages", action="store_true", default=None,
                   help="also emit per-token `advantages`: an answer's format tokens carry its validity credit, "
                        "its action token the decision's Q* credit")
    p.add_argument("--counterfactual", action="store_true", default=None,
                   help="step groups: add both valid calls, forced, to every group, scored by Q* with the policy's "
                        "own logprobs (the exact decision gradient; embedded and hf policies)")
    p.add_argument("--scale-decisions", action="store_true", default=None,
                   help="token advantages: divide each decision's credit by |Q*(hit) - Q*(stick)| (floored at 0.05),"
                        " so every state weighs the same")
    p.add_argument("--format-weight", type=float,
                   help="token advantages: weight of the validity credit on format tokens (default 1; 0: decision only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blackjack-rl",
        description="Train and evaluate LLM agents on Blackjack with reinforcement learning.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("solve", help="exact optimal policy and its value",
                       description="Solve the chosen rules exactly: expected return, outcome odds, strategy chart.")
    _add_rules(p)
    p.add_argument("--json", action="store_true", help="machine-readable output, with every Q*(s, a)")

    p = sub.add_parser("process", help="play groups and write an Atropos dataset (JSONL + HTML)",
                       description="Play N groups (all episodes of a group share one deal) and write "
                                   "OUT/groups.jsonl, one Atropos ScoredDataGroup a line, and OUT/groups.html.")
    _add_play(p)
    p.add_argument("--groups", type=int, help="number of groups (default 8)")
    _add_grouping(p)
    _add_ray(p)

    p = sub.add_parser("evaluate", help="play the fixed evaluation deals and report metrics",
                       description="Play the fixed evaluation seeds and write OUT/metrics.json and OUT/samples.jsonl.")
    _add_play(p)
    p.add_argument("--episodes", type=int, help="evaluation deals (default 1000)")
    p.add_argument("--no-samples", action="store_true", help="do not write samples.jsonl")
    p.add_argument("--grid", action="store_true",
                   help="also the exact strategy chart: P(hit) in all 280 states from the policy's probabilities, "
                        "its exact expected return, accuracy and regret (embedded, hf and bots; in metrics.json "
                        "and report.html)")
    _add_ray(p)

    p = sub.add_parser("serve", help="feed the trajectory API as an environment worker",
                       description="Register with the trajectory API, then play groups and send them, keeping "
                                   "max_batches_offpolicy x batch_size sequences ahead of the trainer. Groups the "
                                   "API cannot take are parked in OUT/outbox.sqlite and sent when it returns. "
                                   "Metrics go to OUT/serve_metrics.jsonl. SIGTERM drains, flushes and disconnects.")
    _add_play(p)
    _add_grouping(p)
    g = p.add_argument_group("trajectory API")
    g.add_argument("--api-url", help="default http://127.0.0.1:8000")
    g.add_argument("--api-token", help="bearer token (or BLACKJACK_RL_SERVE__API_TOKEN)")
    g.add_argument("--env-name", help="name to register under (default blackjack)")
    g.add_argument("--worker-id", help="names this worker: its deals (a restart continues them, see "
                                       "OUT/serve_state.json) and its API registration (a restart takes it over); "
                                       "give each worker its own (default host-pid)")
    g.add_argument("--weight", type=float, help="share of each batch (default 1.0)")
    g.add_argument("--min-batch-allocation", type=float, help="minimum share of each batch (0-1)")
    g.add_argument("--max-batches-offpolicy", type=int, help="batches kept ahead of the trainer (default 3)")
    g.add_argument("--steps-per-eval", type=int, help="evaluate every N trainer steps (default 100, 0 = never)")
    g.add_argument("--eval-episodes", type=int, help="episodes per evaluation (default 200)")
    g.add_argument("--max-groups", type=int, help="stop after sending N groups (default: run until SIGTERM)")
    g.add_argument("--register-timeout", type=float, help="seconds to wait for the trainer (default: forever)")
    g.add_argument("--drain-timeout", type=float, help="on SIGTERM, seconds to finish groups in flight (default 60)")
    g.add_argument("--wandb-project", help="also log metrics to Weights & Biases (pip install 'blackjack-rl[wandb]')")
    _add_ray(p, serve=True)

    p = sub.add_parser("grid", help="exact strategy chart of a policy, from its probabilities (no sampling)",
                       description="Read the policy's P(hit) among its valid calls in each of the 280 chart states "
                                   "(hard 4-21, soft 12-21, dealer A-10) from its logprobs of the two calls, then "
                                   "compute exactly the expected return of that policy, its decision accuracy "
                                   "weighted by its own visits, and its regret. Writes OUT/grid.json and OUT/grid.html.")
    _add_play(p)

    p = sub.add_parser("compare", help="compare evaluation runs deal by deal",
                       description="Compare evaluation runs (folders written by `evaluate`) against the first one. "
                                   "All runs play the same fixed deals, so differences are paired by seed, with 95% "
                                   "confidence intervals. Prints a table and writes OUT/compare.html and OUT/compare.json.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="evaluation folders; the first is the baseline")
    p.add_argument("--out", metavar="DIR", default="runs/compare", help="where to write the page (default runs/compare)")

    from .train.cli import add_train_parser

    add_train_parser(sub, _add_play)

    sub.add_parser("api", help="run the trajectory API (Atropos-compatible)", add_help=False,
                   description="Run the trajectory API; see `blackjack-rl api --help`.")
    return parser


def settings_from_args(args: argparse.Namespace):
    from .config import load_settings

    overrides: dict[str, Any] = {}
    for flag, (section, field) in _OVERRIDES.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        (overrides.setdefault(section, {}) if section else overrides)[field] = value
    concurrency = getattr(args, "concurrency", None)
    if concurrency is not None:
        overrides.setdefault("groups", {})["concurrency"] = concurrency
        overrides.setdefault("evaluate", {})["concurrency"] = concurrency
    if getattr(args, "no_samples", False):
        overrides.setdefault("evaluate", {})["samples"] = False
    if getattr(args, "grid", False):
        overrides.setdefault("evaluate", {})["grid"] = True
    return load_settings(getattr(args, "config", None), overrides)


def _cmd_solve(args: argparse.Namespace, console: Console) -> int:
    from .game import Rules
    from .report.console import print_solution, solution_json
    from .solver import solve

    solution = solve(Rules(natural=bool(args.natural), sab=bool(args.sab)))
    if args.json:
        print(json.dumps(solution_json(solution), indent=2))
    else:
        print_solution(solution, console)
    return 0


def _with_player(settings, job):
    """Build the player the settings describe, run `job(player)`, and always close the policy."""
    import asyncio

    from .runner import build_player

    player = build_player(settings)

    async def main():
        try:
            return await job(player)
        finally:
            await player.policy.aclose()

    return asyncio.run(main())


def _shards(settings):
    """With --ray: the shard scheduler on that cluster (cluster.shards); else None, play here."""
    import contextlib

    r = settings.ray
    if r.address is None:
        return contextlib.nullcontext()
    from .cluster.shards import shards_for

    return shards_for(r.address, settings, r.actors, r.cpus)


def _cmd_process(args: argparse.Namespace, console: Console) -> int:
    from .runner import run_process

    settings = settings_from_args(args)
    with _shards(settings) as shards:
        s = _with_player(settings, lambda player: run_process(settings, player, progress=not args.quiet,
                                                              deals=shards and shards.deals))
    console.print(
        f"Wrote {s.groups_written} groups ({s.episodes} sequences played, {s.episodes_failed} failed"
        + (f", dropped {s.groups_dropped}" if s.groups_dropped else "")
        + f") in {s.seconds:.1f}s to [bold]{s.out_file}[/bold]; browse them in [bold]{s.html_file}[/bold]"
    )
    return 0 if s.episodes_failed == 0 else 3


def _cmd_evaluate(args: argparse.Namespace, console: Console) -> int:
    from .report.console import print_metrics
    from .runner import run_evaluate

    settings = settings_from_args(args)
    with _shards(settings) as shards:
        metrics = _with_player(settings, lambda player: run_evaluate(settings, player, progress=not args.quiet,
                                                                     play=shards and shards.evaluate))
    print_metrics(metrics, console)
    console.print(f"Metrics in [bold]{settings.out}/metrics.json[/bold]"
                  + (f", every episode in [bold]{settings.out}/samples.jsonl[/bold]" if settings.evaluate.samples else "")
                  + f"; the report is [bold]{settings.out}/report.html[/bold]")
    return 0 if metrics.episodes_failed == 0 else 3


def _cmd_grid(args: argparse.Namespace, console: Console) -> int:
    import time
    from pathlib import Path

    from .grid import evaluate_grid
    from .probe import probe_policy
    from .report.gridpage import write_grid_page

    settings = settings_from_args(args)

    async def job(player):
        t0 = time.perf_counter()
        probe = await probe_policy(player)
        return player, probe, time.perf_counter() - t0

    player, probe, seconds = _with_player(settings, job)
    g = evaluate_grid(player.solution, probe.p_hit)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"policy": player.policy.generation_params(), "temperature": probe.temperature, "seconds": seconds,
            "p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None}
    tmp = out / "grid.json.tmp"
    tmp.write_text(json.dumps({**g.to_dict(), **meta}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "grid.json")
    page = write_grid_page(out / "grid.html", f"Strategy chart of {player.policy.name}", g, player.solution, meta)
    console.print(f"exact value {g.value:+.4f} (optimal {g.optimal_value:+.4f}, regret {g.regret:.4f}); "
                  f"accuracy {100 * g.accuracy:.1f}% by visits, {100 * g.cell_accuracy:.1f}% by cell; "
                  f"P(hit) {g.p_hit_hit_optimal:.2f} where hit is optimal, {g.p_hit_stick_optimal:.2f} where stick is "
                  f"({seconds:.1f}s). Chart in [bold]{page}[/bold]")
    return 0


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from .compare import compare_runs
    from .report.comparison import write_comparison
    from .report.console import print_comparison
    from .report.runs import load_runs

    runs = load_runs(args.runs)
    comparisons = compare_runs(runs)
    print_comparison(runs, comparisons, console)
    html, _ = write_comparison(args.out, runs, comparisons)
    console.print(f"Side by side in [bold]{html}[/bold]")
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from .serve import serve

    settings = settings_from_args(args)
    if settings.ray.address is not None:
        return _serve_on_ray(settings, args, console)
    if args.workers is not None:
        raise ValueError("--workers starts worker actors on Ray: add --ray [ADDRESS]")
    wandb_run = None
    if args.wandb_project:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError("--wandb-project needs wandb: pip install 'blackjack-rl[wandb]'") from exc
        wandb_run = wandb.init(project=args.wandb_project, config=settings.model_dump(mode="json"))
    logging.getLogger("blackjack_rl").setLevel(logging.INFO)
    stats = _with_player(settings, lambda player: serve(settings, player, wandb_run))
    console.print(f"Sent {stats.groups_sent} groups ({stats.groups_parked} parked in {settings.out}/outbox.sqlite, "
                  f"{stats.groups_rejected} refused, dropped {stats.groups_dropped or 0}); "
                  f"{stats.episodes} episodes, {stats.episodes_failed} failed. Log: {settings.out}/serve_metrics.jsonl")
    return 0 if stats.groups_rejected == 0 else 3


def _serve_on_ray(settings, args: argparse.Namespace, console: Console) -> int:
    if args.wandb_project:
        raise ValueError("--wandb-project is for one worker; with --ray, each worker logs to OUT/<worker id>/")
    from .cluster.workers import serve_on_ray

    logging.getLogger("blackjack_rl").setLevel(logging.INFO)
    result = serve_on_ray(settings)
    t = result.totals
    console.print(f"{result.workers} workers ({result.restarts} restarts) sent {t.groups_sent} groups "
                  f"({t.groups_parked} parked, {t.groups_rejected} refused, dropped {t.groups_dropped or 0}); "
                  f"{t.episodes} episodes, {t.episodes_failed} failed. Logs: {settings.out}/<worker id>/serve_metrics.jsonl")
    return 0 if t.groups_rejected == 0 else 3


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from .train.cli import cmd_train

    return cmd_train(args, console, settings_from_args, sys.argv[1:])


def user_error(exc: BaseException) -> str:
    """A user error in one line: each bad setting by its flag where it has one, and what is wrong."""
    pydantic = sys.modules.get("pydantic")  # loaded by whatever raised a ValidationError
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        flags = {where: "--" + flag.replace("_", "-") for flag, where in _OVERRIDES.items()}
        parts = []
        for error in exc.errors(include_url=False):
            loc = tuple(str(part) for part in error["loc"])
            flag = flags.get((loc[0], loc[1]) if len(loc) > 1 else (None, loc[0]) if loc else None)
            name = ".".join(loc) or "settings"
            parts.append(f"{name}{f' ({flag})' if flag else ''}: {error['msg']}")
        return "; ".join(parts)
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
    try:
        if argv[:1] == ["api"]:
            from .api.cli import main as api_main

            return api_main(argv[1:])
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        from rich.console import Console

        console = Console(stderr=False)
        handlers = {"solve": _cmd_solve, "process": _cmd_process, "evaluate": _cmd_evaluate, "serve": _cmd_serve,
                    "compare": _cmd_compare, "train": _cmd_train, "grid": _cmd_grid}
        return handlers[args.command](args, console)
    except _user_errors() as exc:  # ValidationError is a ValueError
        # plain print: rich would wrap a long message over several lines and read [..] as markup
        print(f"error: {user_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
