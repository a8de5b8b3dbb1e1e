"""`grid`: the exact strategy chart of a policy, read off its probabilities (grid.json, grid.html)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blackjack_rl.measure.grid import GridEvaluation, evaluate_grid
from blackjack_rl.measure.probe import probe_policy
from blackjack_rl.rollout.players import Player


@dataclass
class GridRun:
    grid: GridEvaluation
    meta: dict[str, Any]
    page: Path
    seconds: float


async def run_grid(out: Path, player: Player) -> GridRun:
    from blackjack_rl.report.gridpage import write_grid_page

    t0 = time.perf_counter()
    probe = await probe_policy(player)
    seconds = time.perf_counter() - t0
    g = evaluate_grid(player.solution, probe.p_hit)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"policy": player.policy.generation_params(), "temperature": probe.temperature, "seconds": seconds,
            "p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None}
    tmp = out / "grid.json.tmp"
    tmp.write_text(json.dumps({**g.to_dict(), **meta}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "grid.json")
    page = write_grid_page(out / "grid.html", f"Strategy chart of {player.policy.name}", g, player.solution, meta)
    return GridRun(g, meta, page, seconds)
