"""The jobs that write files: process and evaluate (their player comes from players.build_player)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from tqdm import tqdm

from .config import Settings
from .episode import Episode
from .evaluate import compute_metrics, run_evaluation
from .deals import play_deal
from .groups import GroupResult, Player
from .outputs import prepare_folder, write_text, writing
from .records import Metrics


def group_seeds(seed: int, n: int) -> list[int]:
    """Training deals: drawn below 2**32, disjoint from the evaluation seeds by construction."""
    rng = random.Random(seed)
    return [rng.randrange(2**32) for _ in range(n)]


@dataclass
class ProcessSummary:
    groups_written: int
    groups_dropped: dict[str, int]
    episodes: int
    episodes_failed: int
    out_file: Path
    html_file: Path | None
    seconds: float


# Plays deals elsewhere (see cluster.shards): seeds in, each deal's results out, in seed order.
DealSource = Callable[[list[int]], AsyncIterator[list[GroupResult]]]
# Plays the first n evaluation deals elsewhere, calling advance(k) as k more finish; episodes in seed order.
EpisodeSource = Callable[[int, Callable[[int], Any]], Awaitable[list[Episode]]]


async def _local_deals(settings: Settings, player: Player, seeds: list[int]) -> AsyncIterator[list[GroupResult]]:
    g = settings.groups
    limiter = asyncio.Semaphore(g.concurrency)
    # Enough groups in flight to keep `concurrency` episodes busy; yielded in seed order.
    window = max(1, g.concurrency // g.sequences) + 1
    pending: list[asyncio.Task[list[GroupResult]]] = []
    next_seed = 0
    while next_seed < len(seeds) or pending:
        while next_seed < len(seeds) and len(pending) < window:
            pending.append(asyncio.create_task(play_deal(player, seeds[next_seed], g, limiter)))
            next_seed += 1
        yield await pending.pop(0)


async def run_process(settings: Settings, player: Player, progress: bool = True,
                      deals: DealSource | None = None) -> ProcessSummary:
    """Groups stream into groups.jsonl.partial, renamed to groups.jsonl only when the run ends well
    (a stopped run keeps what it wrote under the .partial name)."""
    out = prepare_folder(settings.out, "groups.jsonl")
    path = out / "groups.jsonl"
    seeds = group_seeds(settings.seed, settings.process.groups)
    # written in seed order, so the same --seed writes the same file
    results = deals(seeds) if deals is not None else _local_deals(settings, player, seeds)
    dropped: dict[str, int] = {}
    written = episodes = failed = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(seeds), desc="groups", unit="group", disable=not progress)
    from .report.dataset import DatasetView

    # The viewer grows with the file (one chunk at a time), never rebuilt from it.
    view = DatasetView(out / "groups.html", player.chat.backend, source=path.name)
    with writing(path, keep_partial=True) as fh:
        async for deal_results in results:
            for result in deal_results:
                # step groups carry per-answer metadata, not Episode records
                episodes += len(result.episodes) if result.episodes else len(result.group.scores) if result.group else 0
                failed += sum(ep.failed for ep in result.episodes)
                if result.group is None:
                    dropped[result.dropped or "?"] = dropped.get(result.dropped or "?", 0) + 1
                else:
                    fh.write(json.dumps(result.group.to_json(), separators=(",", ":")) + "\n")
                    view.add(result.group)
                    written += 1
            fh.flush()
            bar.update(1)
            bar.set_postfix(written=written, failed_eps=failed)
    bar.close()
    html = view.close()
    return ProcessSummary(written, dropped, episodes, failed, path, html, time.perf_counter() - t0)


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
        episodes = await run_evaluation(player, n, settings.evaluate.concurrency, on_episode=lambda ep: bar.update(1))
    bar.close()
    seconds = time.perf_counter() - t0
    metrics = compute_metrics(episodes, player)
    metrics.seconds = seconds
    metrics.episodes_per_second = len(episodes) / seconds if seconds > 0 else None
    if settings.evaluate.grid:
        from .probe import exact_grid

        metrics.grid = await exact_grid(player)
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
    from .report.evaluation import write_report

    write_report(out / "report.html", metrics, rows, player.solution)
    write_text(out / "metrics.json", metrics_text)  # last: its presence says the run is complete
    return metrics
