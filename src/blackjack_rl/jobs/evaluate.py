"""`evaluate`: play the fixed evaluation deals, then write samples.jsonl, report.html and metrics.json."""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable

from tqdm import tqdm

from blackjack_rl.config import Settings
from blackjack_rl.contract.records import Metrics
from blackjack_rl.measure.evaluation import compute_metrics
from blackjack_rl.outputs import prepare_folder, write_text, writing
from blackjack_rl.rollout.episodes import Episode
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import DealRunner

# Plays the first n evaluation deals elsewhere, calling advance(k) as k more finish; episodes in seed order.
EpisodeSource = Callable[[int, Callable[[int], Any]], Awaitable[list[Episode]]]


async def run_evaluate(settings: Settings, player: Player, progress: bool = True,
                       play: EpisodeSource | None = None) -> Metrics:
    """Writes samples.jsonl, report.html, then metrics.json, each whole or not at all: a folder
    with a metrics.json holds a finished run, and only this run's files."""
    out = prepare_folder(settings.out, "metrics.json", "samples.jsonl", "report.html")
    n = settings.evaluate.episodes
    bar = tqdm(total=n, desc="episodes", unit="ep", disable=not progress)
    t0 = time.perf_counter()
    if play is not None:
        episodes = await play(n, bar.update)
    else:
        runner = DealRunner(player, settings.groups, settings.evaluate.concurrency)
        episodes = await runner.evaluation(n, on_episode=lambda ep: bar.update(1))
    bar.close()
    seconds = time.perf_counter() - t0
    metrics = compute_metrics(episodes, player)
    metrics.seconds = seconds
    metrics.episodes_per_second = len(episodes) / seconds if seconds > 0 else None
    if settings.evaluate.grid:
        from blackjack_rl.measure.probe import exact_grid

        metrics.grid = await exact_grid(player, settings.evaluate.game_budget)
    try:
        metrics_text = json.dumps(metrics.to_json(), indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise ValueError("the metrics hold a number that is not finite (NaN or infinity); nothing was written. "
                         "Check --invalid-score and --format-bonus") from None
    rows = [ep.sample_row() for ep in episodes]
    if settings.evaluate.samples:
        with writing(out / "samples.jsonl") as fh:
            for row in rows:
                fh.write(json.dumps(row.to_json()) + "\n")
    from blackjack_rl.report.evaluation import write_report

    write_report(out / "report.html", metrics, rows, player.solution)
    write_text(out / "metrics.json", metrics_text)  # last: its presence says the run is complete
    return metrics


def evaluate_settings(settings: Settings, progress: bool = True, play: EpisodeSource | None = None) -> Metrics:
    """`evaluate` as a whole: build the player the settings describe, play, write, and always
    close the player (a llama.cpp model or a server pool holds threads and sockets)."""
    from blackjack_rl.rollout.players import run_with_player

    return run_with_player(settings, lambda player: run_evaluate(settings, player, progress, play))
