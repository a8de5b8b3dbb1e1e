"""Paths as a run's records (command.txt, settings.json) write them: never an absolute path of the
machine that ran it, so a run folder can be committed or copied as it is.

A relative path is written as it was given (relative to the folder the command ran in). An
absolute one is written relative to that folder when it lies under it; otherwise relative to the
folder holding the run (runs side by side, `--out /data/exp/p2 --base-adapter /data/exp/p1/...`,
read `--out p2 --base-adapter p1/...`); otherwise by its name alone.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any


def portable_path(value: str | PurePath, run_dir: str | Path, cwd: str | Path | None = None) -> str:
    text = str(value)
    if not os.path.isabs(text):
        return text
    path = Path(os.path.normpath(text))
    here = Path(os.path.abspath(cwd if cwd is not None else os.getcwd()))
    holder = Path(os.path.abspath(run_dir)).parent
    for base in (here, holder):
        if base.parent == base:  # the filesystem's root: what lies under it is still this machine's layout
            continue
        try:
            return path.relative_to(base).as_posix() or "."
        except ValueError:
            continue
    return path.name or "."


def portable_argv(argv: list[str], run_dir: str | Path, cwd: str | Path | None = None) -> list[str]:
    """The command line with every absolute path made portable (`--flag=PATH` too)."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("-") and os.path.isabs(value):
            out.append(f"{flag}={portable_path(value, run_dir, cwd)}")
        else:
            out.append(portable_path(arg, run_dir, cwd) if os.path.isabs(arg) else arg)
    return out


def portable_values(data: Any, run_dir: str | Path, cwd: str | Path | None = None) -> Any:
    """JSON-like data (dumped settings) with every absolute path in it made portable."""
    if isinstance(data, dict):
        return {k: portable_values(v, run_dir, cwd) for k, v in data.items()}
    if isinstance(data, list):
        return [portable_values(v, run_dir, cwd) for v in data]
    if isinstance(data, str) and os.path.isabs(data):
        return portable_path(data, run_dir, cwd)
    return data
