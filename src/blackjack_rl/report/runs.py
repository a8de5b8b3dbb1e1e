"""Reading evaluation runs back from their folders (metrics.json + samples.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pydantic import ValidationError

from blackjack_rl.measure.compare import Run
from blackjack_rl.contract.records import Metrics, SampleRow


def load_run(folder: str | Path, name: str | None = None) -> Run:
    folder = Path(folder)
    metrics_path, samples_path = folder / "metrics.json", folder / "samples.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{folder} is not an evaluation run (no metrics.json): "
                                f"create one with `blackjack-rl evaluate --out {folder}`")
    if not samples_path.is_file():
        raise FileNotFoundError(f"{folder} has no samples.jsonl: runs are compared episode by episode, "
                                "so evaluate them without --no-samples")
    try:
        data = json.loads(metrics_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{metrics_path} is not valid JSON ({exc}); evaluate the run again") from None
    try:
        metrics = Metrics.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{metrics_path} does not hold an evaluation's metrics ({_first_error(exc)}); "
                         "evaluate the run again") from None
    rows = []
    with samples_path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{samples_path}:{number} is not valid JSON ({exc}); was the run interrupted?") from exc
            try:
                rows.append(SampleRow.model_validate(data))
            except ValidationError as exc:
                raise ValueError(f"{samples_path}:{number} is not an evaluated episode ({_first_error(exc)}); "
                                 "evaluate the run again") from None
    return Run(name or folder.name, metrics, rows)


def _first_error(exc: ValidationError) -> str:
    """The first thing wrong, in one line: where and what."""
    e = exc.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "the top level"
    return f"{where}: {e['msg']}"


def load_runs(folders: Sequence[str | Path]) -> list[Run]:
    """Runs named by their folder; by their path where two folders share a name."""
    paths = [Path(f) for f in folders]
    names = [p.name for p in paths]
    return [load_run(p, p.name if names.count(p.name) == 1 else str(p)) for p in paths]
