"""`process`: play groups and write them as an Atropos dataset (groups.jsonl and its viewer)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from tqdm import tqdm

from blackjack_rl.config import Settings
from blackjack_rl.outputs import prepare_folder, writing
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import DealResult, DealRunner, Tally, group_seeds

# Plays deals elsewhere (see cluster.shards): seeds in, each deal's result out, in seed order.
DealSource = Callable[[list[int]], AsyncIterator[DealResult]]


@dataclass
class ProcessSummary:
    groups_written: int
    tally: Tally
    out_file: Path
    html_file: Path | None
    seconds: float


async def run_process(settings: Settings, player: Player, progress: bool = True,
                      deals: DealSource | None = None) -> ProcessSummary:
    """Groups stream into groups.jsonl.partial, renamed to groups.jsonl only when the run ends well
    (a stopped run keeps what it wrote under the .partial name)."""
    out = prepare_folder(settings.out, "groups.jsonl")
    path = out / "groups.jsonl"
    seeds = group_seeds(settings.seed, settings.process.groups)
    runner = DealRunner(player, settings.groups, settings.groups.concurrency)
    # written in seed order, so the same --seed writes the same file
    results = deals(seeds) if deals is not None else runner.stream(seeds)
    tally = runner.tally if deals is None else Tally()
    written = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(seeds), desc="groups", unit="group", disable=not progress)
    from blackjack_rl.report.dataset import DatasetView

    # The viewer grows with the file (one chunk at a time), never rebuilt from it.
    view = DatasetView(out / "groups.html", player.chat.backend, source=path.name)
    with writing(path, keep_partial=True) as fh:
        async for deal in results:
            if deals is not None:  # played elsewhere: counted here
                tally.add(deal)
            for result in deal.groups:
                if result.group is not None:
                    fh.write(json.dumps(result.group.to_json(), separators=(",", ":")) + "\n")
                    view.add(result.group)
                    written += 1
            fh.flush()
            bar.update(1)
            bar.set_postfix(written=written, failed_eps=tally.episodes_failed)
    bar.close()
    html = view.close()
    return ProcessSummary(written, tally, path, html, time.perf_counter() - t0)
