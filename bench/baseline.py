"""The baseline of the start-up and chat-path benchmarks: this project at an earlier commit.

The Atropos original cannot run here as a command line (its environment needs atroposlib's
full stack: wandb, datasets, an OpenAI client, ...), so the benchmarks compare against our own
code before the speed work, run the same way in the same run. `git archive` unpacks that
commit's `src/` into a temporary folder, without touching the repository or its worktrees;
PYTHONPATH puts it ahead of the installed (editable) package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The last commit before the start-up and chat-path work (lazy imports, aiohttp, tokenizer folders).
DEFAULT_REV = "82a3919"


def unpack(rev: str) -> Path:
    """`src/` of `rev` in a fresh temporary folder; returns the folder to put on PYTHONPATH."""
    out = Path(tempfile.mkdtemp(prefix=f"blackjack-rl-{rev}-"))
    archive = out / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    archive.unlink()
    return out / "src"


def cli_env(src: Path | None) -> dict[str, str]:
    """The environment that runs `python -m blackjack_rl.cli` from `src` (None: the working tree)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src if src is not None else ROOT / "src")
    env.pop("PYTHONSTARTUP", None)
    # a user's commands import from cached bytecode; without it every timed run would compile each
    # module it imports from source, a cost no user pays twice
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def check_source(src: Path | None) -> None:
    """Fail loudly if PYTHONPATH does not win over the installed package (the numbers would lie),
    then compile the tree's bytecode, as an install does. Otherwise the first timed command of a
    freshly unpacked baseline compiles its modules, and a row that subtracts two runs (marginal CPU
    per episode) counts that compile against the smaller run only."""
    out = subprocess.run([sys.executable, "-c", "import blackjack_rl; print(blackjack_rl.__file__)"],
                         env=cli_env(src), capture_output=True, text=True, check=True).stdout.strip()
    want = (src if src is not None else ROOT / "src").resolve()
    if not Path(out).resolve().is_relative_to(want):
        raise SystemExit(f"blackjack_rl loads from {out}, not from {want}")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(want)], env=cli_env(src), check=True)


def load() -> str:
    """The machine's load, printed beside every number: these machines are shared."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
