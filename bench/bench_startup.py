"""Start-up benchmark: `blackjack-rl --help` and `blackjack-rl solve`, against a baseline.

Run: python bench/bench_startup.py [--repeats 5] [--baseline REV]

Each command runs `--repeats` times as `python -m blackjack_rl.cli ...`, alternating between
the working tree and the baseline (this project at an earlier commit, see bench/baseline.py), and
the median wall and CPU time are printed side by side, with how many modules each imported and
the heaviest imports by `python -X importtime` (cumulative microseconds, one run each). A bare
`python -c pass` is measured the same way: no command can start faster than the interpreter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline  # noqa: E402
from baseline import load  # noqa: E402

COMMANDS = {"--help": ["--help"], "solve": ["solve"]}
COUNT = ("import runpy, sys; sys.argv = ['blackjack-rl'] + {args!r}\n"
         "try:\n    runpy.run_module('blackjack_rl.cli', run_name='__main__')\n"
         "except SystemExit:\n    pass\nprint(len(sys.modules), file=sys.stderr)")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def heaviest(args: list[str], env: dict[str, str], n: int = 6) -> list[tuple[int, str]]:
    """Top-level imports by cumulative import time (microseconds), from `python -X importtime`."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "blackjack_rl.cli", *args], env=env,
                         capture_output=True, text=True).stderr
    tops = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if not name.startswith("   ") and cumulative.strip().isdigit():  # a top-level import
            tops.append((int(cumulative), name.strip()))
    return sorted(tops, reverse=True)[:n]


def modules(args: list[str], env: dict[str, str]) -> int:
    err = subprocess.run([sys.executable, "-c", COUNT.format(args=args)], env=env, capture_output=True, text=True).stderr
    return int(err.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default=baseline.DEFAULT_REV, help="the commit to compare against")
    args = parser.parse_args()

    old = baseline.unpack(args.baseline)
    try:
        baseline.check_source(old)
        sides = {"ours": baseline.cli_env(None), f"baseline {args.baseline}": baseline.cli_env(old)}
        print(f"# Start-up: {os.cpu_count()} CPUs, {args.repeats} runs each, medians; {load()} at start\n")
        bare = [timed([sys.executable, "-c", "pass"], sides["ours"]) for _ in range(args.repeats)]
        print(f"python -c pass: {statistics.median(w for w, _ in bare):.3f} s wall, "
              f"{statistics.median(c for _, c in bare):.3f} s CPU\n")
        print(f"{'command':10} {'side':20} {'wall s':>8} {'CPU s':>8} {'modules':>8}   heaviest imports (ms)")
        for label, cmd_args in COMMANDS.items():
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, env in sides.items():  # alternating, so both see the same load
                    results[name].append(timed([sys.executable, "-m", "blackjack_rl.cli", *cmd_args], env))
            walls = {}
            for name, env in sides.items():
                walls[name] = statistics.median(w for w, _ in results[name])
                cpu = statistics.median(c for _, c in results[name])
                top = ", ".join(f"{mod} {us / 1000:.0f}" for us, mod in heaviest(cmd_args, env))
                print(f"{label:10} {name:20} {walls[name]:8.3f} {cpu:8.3f} {modules(cmd_args, env):8d}   {top}")
            print(f"{'':10} {'baseline / ours':20} {walls[f'baseline {args.baseline}'] / walls['ours']:7.1f}x\n")
        print(f"{load()} at the end")
    finally:
        shutil.rmtree(old.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
