"""What a run writes as it goes: train_log.jsonl, one row per step ("kind": "step"), evaluation
("eval") and chart before training ("grid"), and the one line per row it prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TrainLog:
    """train_log.jsonl, flushed row by row (a run stopped at any point keeps every step it took);
    a resumed run appends to it."""

    def __init__(self, path: Path, *, append: bool) -> None:
        self.path = path
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def step_line(row: dict[str, Any], steps: int) -> str:
    if not row.get("groups"):
        return f"step {row['step']:>4}/{steps}  no groups"

    def pct(key: str) -> str:
        v = row.get(key)
        return f"{100 * v:5.1f}%" if v is not None else "    -"

    score = row.get("mean_score")
    rate = row.get("sample_tokens_per_s")
    train_rate = row.get("train_tokens_per_s")
    return (
        f"step {row['step']:>4}/{steps}  score {f'{score:+.3f}' if score is not None else '-'}  "
        f"valid {pct('valid_call_rate')}  "
        f"accuracy {pct('decision_accuracy')}  win {pct('win_rate')}  "
        + (f"P(hit) {row['p_hit_hit_optimal']:.2f}|{row['p_hit_stick_optimal']:.2f}  "
           if row.get("p_hit_hit_optimal") is not None and row.get("p_hit_stick_optimal") is not None else "")
        + (f"P(call) {row['p_valid_call']:.3f}  " if row.get("p_valid_call") is not None else "")
        + f"trained {row.get('trained_groups', 0)}/{row['groups']} groups  "
        f"sample {f'{rate:.0f}' if rate else '-'} tok/s  train {f'{train_rate:.0f}' if train_rate else '-'} tok/s  "
        f"{row['seconds']:.0f}s"
    )


def eval_line(row: dict[str, Any]) -> str:
    s = row["summary"]

    def ci(key: str) -> str:
        v = s[key]
        return f"{100 * v['rate']:.1f}% [{100 * v['ci95_low']:.1f}, {100 * v['ci95_high']:.1f}]"

    return (
        f"eval @ step {row['step']}: {s['episodes']} deals  valid answers {ci('valid_decisions')}  "
        f"win {ci('win')}  accuracy {ci('decision_accuracy')}  ({row['seconds']:.0f}s)"
    )


def fidelity_line(row: dict[str, Any]) -> str:
    """The credit against A^pi (train/trainer.py `_fidelity`): sign over clear decisions, correlation, noise."""
    where = f"{row.get('fidelity_deals', 0)} probe deals" if row["fidelity_of"] == "probe" else "the batch"
    doc = row.get("fidelity")
    if doc is None:
        return f"  fidelity @ step {row['step']}: no valid decision in {where}"
    f = doc["scores"]["all"]

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    return (f"  fidelity @ step {row['step']} ({where}, {f['decisions']} credits): sign {num(f['sign_clear'], '.3f')} "
            f"(|A| >= 0.01)  correlation {num(f['correlation'], '.3f')}  bias {num(f['bias'], '+.4f')}  "
            f"noise {num(f['noise'], '.3f')}  ({row['fidelity_seconds']:.0f} s)")


def grid_line(row: dict[str, Any]) -> str:
    return (
        f"  grid @ step {row['step']}: accuracy {100 * row['grid_accuracy']:.1f}%  value {row['grid_value']:+.4f}  "
        f"regret {row['grid_regret']:.4f}  P(hit) hit-optimal {row['grid_p_hit_hit_optimal']:.2f} vs "
        f"stick-optimal {row['grid_p_hit_stick_optimal']:.2f}"
    )
