"""The layers of the package (pyproject's import-linter contract) hold, and a planted upward
import breaks them: the check that keeps the data flow one way cannot pass by accident."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import SRC

ROOT = SRC.parent


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", script, "--config", str(config), "--no-cache"],
                          cwd=src.parent, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contract_holds():
    run = _lint(SRC, ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 kept, 0 broken" in run.stdout


def test_the_contract_names_every_top_level_part_of_the_package():
    """A new top-level module or package outside the contract would escape it."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {name.strip().removeprefix("blackjack_rl.") for layer in layers for name in layer.split("|")}
    package = SRC / "blackjack_rl"
    parts = {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert parts == named, (sorted(parts - named), sorted(named - parts))


def test_an_upward_import_breaks_the_contract(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC / "blackjack_rl", copy / "blackjack_rl", ignore=shutil.ignore_patterns("__pycache__"))
    table = copy / "blackjack_rl" / "game" / "table.py"
    table.write_text(table.read_text() + "\nfrom blackjack_rl.rollout import runner  # planted: the game reaching up\n")
    run = _lint(copy, ROOT / "pyproject.toml")
    assert run.returncode != 0
    assert "BROKEN" in run.stdout and "blackjack_rl.game.table -> blackjack_rl.rollout.runner" in run.stdout
