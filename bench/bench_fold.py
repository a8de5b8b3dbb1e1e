"""The trained adapter on the embedded model: applied by llama.cpp at every token, or folded into the
weights once (`--lora-fold`), as whole commands side by side.

Run alone on the machine (llama.cpp's numbers mean nothing beside other CPU work):

    python bench/bench_fold.py [--lora whole-game] [--episodes 100] [--repeats 2] [--folds f16 q8_0]

Each round runs `blackjack-rl evaluate --lora NAME --episodes N` (the run-time adapter, the
baseline) and the same with `--lora-fold TYPE` for each fold, one after the other, so that all
see the same machine. The folds are made (and cached) before the first round, so the rounds time
play, not folding. Prints the median wall time of each, its ratio to the baseline, and the
metrics each run reported: a fold re-encodes the adapted weights, so its answers may differ
(docs/inference.md), and the table shows by how much on these deals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import load  # noqa: E402


def run(args: list[str], out: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "blackjack_rl.cli", "evaluate", *args, "--quiet", "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", default="whole-game", help="a shipped adapter's name or a peft folder")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folds", nargs="+", default=["f16", "q8_0"], choices=["f16", "q8_0"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from blackjack_rl.policies.gguf_fold import folded_gguf

    for fold in args.folds:
        folded_gguf(args.lora, None, fold)  # made once here, cached: the rounds time play only
    common = ["--lora", args.lora, "--episodes", str(args.episodes), "--max-tokens", "40", "--temperature", "1.0",
              "--threads", str(args.threads)]
    sides = {"run-time adapter": [], **{f"folded {fold}": ["--lora-fold", fold] for fold in args.folds}}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    metrics: dict[str, dict] = {}
    print(f"# --lora {args.lora}, {args.episodes} episodes, {args.threads} threads; {load()} at start\n")
    with tempfile.TemporaryDirectory(prefix="bench-fold-") as work:
        for r in range(args.repeats):
            for name, extra in sides.items():
                wall, metrics[name] = run([*common, *extra], Path(work) / f"{name.split()[-1]}-{r}")
                walls[name].append(wall)
                print(f"  round {r + 1} [{name}]: {wall:.1f} s ({load()})")
    base = statistics.median(walls["run-time adapter"])
    print(f"\n{'':18} {'median wall s':>14} {'ratio':>7} {'valid calls':>12} {'decisions right':>16} "
          f"{'expected score':>15}")
    for name in sides:
        m, wall = metrics[name], statistics.median(walls[name])
        valid = m["valid_decisions"] / max(1, m["decisions"])
        print(f"{name:18} {wall:14.1f} {base / wall:6.2f}x {valid:12.4f} {m['decision_accuracy']['rate']:16.4f} "
              f"{m['mean_expected_score']['mean']:15.4f}")
    print(f"\n{load()} at the end")


if __name__ == "__main__":
    main()
