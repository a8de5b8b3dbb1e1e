"""Adapters trained by this project's recipes, shipped inside the package.

`--lora three-phase` plays one on the embedded model (llama.cpp reads its adapter.gguf), and
`--policy hf --model-path three-phase` loads its peft weights over the same base, with no clone
of the repository and no conversion. Each folder is named after the recipe that trained it
(train/recipes/NAME.yaml); docs/training/ holds the run's log, curves and reports.

A path that exists always wins over a shipped name, so a user's folder is never shadowed.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

GGUF = "adapter.gguf"


def names() -> list[str]:
    root = resources.files(__name__)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / GGUF).is_file())


def folder(name: str) -> Path | None:
    """The shipped adapter folder called `name`, or None."""
    if name not in names():
        return None
    return Path(str(resources.files(__name__) / name))


def lora_file(value: str) -> Path:
    """What `--lora VALUE` names: a .gguf adapter or peft folder on disk, or a shipped adapter's GGUF."""
    path = Path(value)
    if path.exists():
        return path
    shipped = folder(value)
    if shipped is None:
        hint = f" (shipped adapters: {', '.join(names())})" if names() else ""
        raise FileNotFoundError(f"no LoRA adapter at {value}{hint}")
    return shipped / GGUF


def model_folder(value: str | None) -> str | None:
    """What `--model-path VALUE` names for the torch policy: the path, or a shipped adapter's folder."""
    if value is None or Path(value).exists():
        return value
    shipped = folder(value)
    return str(shipped) if shipped is not None else value
