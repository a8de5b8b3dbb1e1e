"""`grid`: the exact strategy chart of a policy, read off its probabilities (grid.json, grid.html)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from blackjack_rl.measure.grid import GridEvaluation, evaluate_grid
from blackjack_rl.measure.probe import exact_game, probe_policy
from blackjack_rl.outputs import prepare_folder, write_text
from blackjack_rl.rollout.players import Player


@dataclass
class GridRun:
    grid: GridEvaluation
    meta: dict[str, Any]  # "whole_game": the exact whole-game numbers (measure/tree.py), or None
    page: Path
    seconds: float  # reading the chart; the whole game's time is its own "seconds"

    @property
    def game(self) -> dict[str, Any] | None:
        return self.meta["whole_game"]


async def run_grid(out: Path, player: Player, progress: bool = True, game_budget: int | None = None) -> GridRun:
    """The chart, then the whole game from its first decisions on (the chart's readings reused),
    unless `game_budget` is 0: a trained model's tree takes minutes where its chart takes one or two."""
    from blackjack_rl.report.gridpage import write_grid_page

    prepare_folder(out, "grid.json")  # before minutes of work; grid.json, written last, marks a finished chart
    t0 = time.perf_counter()
    probe = await probe_policy(player)
    seconds = time.perf_counter() - t0
    g = evaluate_grid(player.solution, probe.p_hit)
    bar = tqdm(desc="game tree", unit="history", disable=None if progress and game_budget != 0 else True)

    def advance(nodes: int, width: float) -> None:
        bar.update(nodes - bar.n)
        bar.set_postfix(width=f"{width:.4f}", refresh=False)

    game = await exact_game(player, game_budget, probe=probe, progress=advance)
    bar.close()
    meta = {"policy": player.policy.generation_params(), "temperature": probe.temperature, "seconds": seconds,
            "p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None,
            "whole_game": game}
    page = write_grid_page(out / "grid.html", f"Strategy chart of {player.policy.name}", g, player.solution, meta)
    write_text(out / "grid.json", json.dumps({**g.to_dict(), **meta}, indent=2) + "\n")
    return GridRun(g, meta, page, seconds)
