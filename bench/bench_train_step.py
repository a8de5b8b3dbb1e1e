"""Seconds per training step of a shipped recipe's phase: the working tree against an earlier commit.

Run alone on the machine (torch uses both cores; anything beside it moves the numbers):

    python bench/bench_train_step.py [--recipe reward-only] [--phase decision] [--steps 6]
                                     [--baseline REV] [--repeats 1] [--base-adapter DIR]

The phase's settings (the recipe's shared ones, then the phase's own) go to a `--config` file,
the periodic chart is turned off, and `blackjack-rl train --config FILE --steps N` runs it with
each tree, in turns, so both see the same machine. The reward-only decision phase takes its
continuation snapshot at steps 1, 6, 11...; the first step also fills the frozen trunk's cache
of the chart prompts, so the medians leave it out (6 steps: one snapshot, four steps without). Without
`--base-adapter` (the format phase's adapter) the phase trains a fresh LoRA over the base model:
the per-step work is the same kind, not the committed run's own numbers. Prints the median
seconds of the steps with and without a snapshot and their ratio to the baseline, and checks
that both trees logged the same steps (every number but the timings): a speed change here must
not change what is trained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import check_source, cli_env, load, unpack  # noqa: E402

# The commit before the scoring work (the vocabulary head once per shared state, one prefix per batch).
DEFAULT_REV = "5a4f04c"
TIMINGS = {"seconds", "train_seconds", "elapsed", "sample_tokens_per_s", "train_tokens_per_s"}


def phase_config(recipe: str, phase: str, steps: int, base_adapter: str | None) -> dict:
    from blackjack_rl.train.recipe import merged, recipe_text

    spec = yaml.safe_load(recipe_text(recipe)[0])
    phases = {p["name"]: p for p in spec["phases"]}
    if phase not in phases:
        raise SystemExit(f"--phase: {recipe} has no phase {phase!r} (it has {', '.join(phases)})")
    cfg = merged(spec.get("settings", {}), phases[phase].get("settings", {}))
    train = cfg.setdefault("train", {})
    train.update(steps=steps, grid_every=0, save_every=0, eval_episodes=0)
    if base_adapter:
        train["base_adapter"] = str(Path(base_adapter).resolve())
    cfg["seed"] = phases[phase].get("seed", 0)
    return cfg


def run(src: Path | None, config: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "blackjack_rl.cli", "train", "--config", str(config), "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=cli_env(src), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"  {'baseline' if src else 'working tree'}: {time.perf_counter() - t0:.0f} s ({load()})", flush=True)
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == "step"]


def seconds(rows: list[dict], snapshot: bool) -> list[float]:
    """Step seconds after the first (which also fills the frozen trunk's cache of the chart prompts)."""
    return [r["seconds"] for r in rows if r["step"] > 1 and bool(r.get("continuation_scored")) == snapshot]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="reward-only")
    ap.add_argument("--phase", default="decision")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--baseline", default=DEFAULT_REV, help="git revision to compare with")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--base-adapter", help="the adapter the phase trains over (the format phase's)")
    args = ap.parse_args()
    if not 2 <= args.steps <= 100 or not 1 <= args.repeats <= 10:
        raise SystemExit("--steps: 2 to 100 (the first step is left out); --repeats: 1 to 10")
    work = Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    config = work / "phase.yaml"
    config.write_text(yaml.safe_dump(phase_config(args.recipe, args.phase, args.steps, args.base_adapter)))
    src = unpack(args.baseline)
    check_source(src)
    check_source(None)
    logs: dict[str, list[list[dict]]] = {"baseline": [], "working tree": []}
    for i in range(args.repeats):
        print(f"round {i + 1}", flush=True)
        logs["baseline"].append(run(src, config, work / f"base-{i}"))
        logs["working tree"].append(run(None, config, work / f"tree-{i}"))
    same = all([{k: v for k, v in r.items() if k not in TIMINGS} for r in a] ==
               [{k: v for k, v in r.items() if k not in TIMINGS} for r in b]
               for a, b in zip(logs["baseline"], logs["working tree"]))
    print(f"\n{args.recipe} / {args.phase}, {args.steps} steps, median seconds per step after the first "
          f"({args.repeats} rounds)")
    print(f"{'':>14} {'with a snapshot':>16} {'without':>10}")
    medians = {}
    for name, runs in logs.items():
        rows = [r for log in runs for r in log]
        medians[name] = [statistics.median(x) if x else float("nan") for x in (seconds(rows, True), seconds(rows, False))]
        print(f"{name:>14} {medians[name][0]:16.1f} {medians[name][1]:10.1f}")
    b, w = medians["baseline"], medians["working tree"]
    print(f"{'ratio':>14} {b[0] / w[0]:15.2f}x {b[1] / w[1]:9.2f}x   (baseline / working tree)")
    print(f"the same steps logged by both (timings aside): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
