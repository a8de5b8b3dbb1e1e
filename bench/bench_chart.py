"""Strategy-chart benchmark: `blackjack-rl grid` on the embedded model, against a baseline and the prefill floor.

Run: python bench/bench_chart.py [--rounds 2] [--baseline REV] [--lora NAME] [--game-budget N]

The chart scores the two calls in each of the 280 opening states. Each round runs
`blackjack-rl grid --game-budget 0` as a whole command with the working tree and with the baseline
(this project at an earlier commit, see bench/baseline.py), in turns, and prints each one's wall
time, chart value and cell accuracy. Then, in this process, the floor: the chart's own tokens (each
cell's part of its prompt after what it shares with the previous cell, the calls' shared beginning
once, both calls' ends) decoded in llama.cpp in chunks of 512 with no logits, which is as fast as
llama.cpp prefills on this machine; the chart cannot take less. Printed: ours against the baseline
(the value must agree to 1e-4, the cell accuracy exactly) and ours against the floor.
With `--game-budget N` the command reads the whole game too (N histories, the chart's 270 first
decisions among them), and the tree's own seconds and certified interval are compared as well.
Run it alone: llama.cpp beside other CPU work measures the other work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline  # noqa: E402
from baseline import cli_env, load  # noqa: E402


def chart(src: Path | None, out: Path, lora: str | None, game_budget: int = 0) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "blackjack_rl.cli", "grid", "--game-budget", str(game_budget), "--quiet",
           "--out", str(out)]
    if lora:
        cmd += ["--lora", lora]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=cli_env(src), check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, json.loads((out / "grid.json").read_text())


def chart_tokens() -> tuple[int, list[int]]:
    """The number of tokens the chart must decode, and a prompt to decode them after."""
    from blackjack_rl.contract.protocol import tool_call_text
    from blackjack_rl.contract.tokens import common_prefix_length
    from blackjack_rl.game.solver import GRID_STATES, HIT, STICK
    from blackjack_rl.game.table import Observation
    from blackjack_rl.policies.embedded import EmbeddedPolicy
    from blackjack_rl.rollout.episodes import opening_messages

    policy = EmbeddedPolicy(n_threads=1)
    chat = policy.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(STICK))]
    shared = common_prefix_length(calls)
    per_cell = shared + sum(len(c) - shared for c in calls)
    total, prev = 0, []
    for k in GRID_STATES:
        prompt = chat.prompt_ids(opening_messages(Observation(*k), False))
        total += len(prompt) - common_prefix_length((prev, prompt)) + per_cell
        prev = prompt
    return total, prev


def floor_seconds(tokens: int, prompt: list[int]) -> float:
    """`tokens` decoded in chunks of 512 after a chart prompt, no logits: llama.cpp's best prefill here."""
    from blackjack_rl.contract.tokens import embedded_model_path
    from blackjack_rl.policies.llama_load import load_llama
    from blackjack_rl.threads import usable_cpus

    n = usable_cpus()
    llama = load_llama(model_path=str(embedded_model_path()), n_ctx=2048, n_batch=512, n_threads=n,
                       n_threads_batch=n, logits_all=False, verbose=False)
    filler = (prompt * 4)[:512]
    base = prompt[:-1]
    llama.eval(base)
    done, t0 = 0, time.perf_counter()
    while done < tokens:
        chunk = filler[: min(512, tokens - done)]
        llama.n_tokens = len(base)
        llama._ctx.kv_cache_seq_rm(-1, len(base), -1)
        llama.eval(chunk)
        done += len(chunk)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", default="bdbcff0", help="the commit to compare against")
    parser.add_argument("--lora", help="an adapter to chart with (a shipped name or a path)")
    parser.add_argument("--game-budget", type=int, default=0, help="histories of the whole game to read too")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-chart-"))
    old = baseline.unpack(args.baseline)
    baseline.check_source(old)
    baseline.check_source(None)
    sides = {"ours": None, f"baseline {args.baseline}": old}
    times: dict[str, list[float]] = {name: [] for name in sides}
    trees: dict[str, list[float]] = {name: [] for name in sides}
    grids: dict[str, dict] = {}
    print(f"# The exact chart (280 cells), `grid --game-budget {args.game_budget}`"
          f"{' --lora ' + args.lora if args.lora else ''}; "
          f"{os.cpu_count()} CPUs; {load()} at start\n")
    try:
        for r in range(args.rounds):
            for name, src in sides.items():
                seconds, grids[name] = chart(src, work / f"{name.split()[0]}-{r}", args.lora, args.game_budget)
                times[name].append(seconds)
                game = grids[name]["whole_game"]
                tree = f", tree {game['seconds']:.1f} s of it" if game else ""
                trees[name].append(game["seconds"] if game else 0.0)
                print(f"  round {r + 1} [{name}]: {seconds:.1f} s{tree}, value {grids[name]['value']:.6f}, "
                      f"cells right {grids[name]['cell_accuracy']:.4f} ({load()})", flush=True)
        tokens, prompt = chart_tokens()
        floor = floor_seconds(tokens, prompt)
        ours, base = statistics.median(times["ours"]), statistics.median(times[f"baseline {args.baseline}"])
        g_ours, g_base = grids["ours"], grids[f"baseline {args.baseline}"]
        print(f"\nfloor: {tokens} tokens in chunks of 512, no logits: {floor:.1f} s ({tokens / floor:.0f} tokens/s)")
        print(f"{'row':44} {'baseline':>10} {'ours':>10} {'ratio':>8}")
        print(f"{'chart, whole command, median s':44} {base:10.1f} {ours:10.1f} {base / ours:7.2f}x")
        print(f"{'ours against the floor':44} {'':>10} {ours / floor:9.2f}x {'goal 1.3x':>8}")
        print(f"{'value':44} {g_base['value']:10.6f} {g_ours['value']:10.6f} "
              f"{'agree' if abs(g_base['value'] - g_ours['value']) <= 1e-4 else 'DIFFER':>8}")
        print(f"{'cell accuracy':44} {g_base['cell_accuracy']:10.4f} {g_ours['cell_accuracy']:10.4f} "
              f"{'same' if g_base['cell_accuracy'] == g_ours['cell_accuracy'] else 'DIFFER':>8}")
        print(f"{'P(one of the two calls), mean':44} {g_base['p_calls']:10.6f} {g_ours['p_calls']:10.6f}")
        if args.game_budget:
            t_ours = statistics.median(trees["ours"])
            t_base = statistics.median(trees[f"baseline {args.baseline}"])
            w_ours, w_base = g_ours["whole_game"], g_base["whole_game"]
            print(f"{'whole-game tree, median s':44} {t_base:10.1f} {t_ours:10.1f} {t_base / t_ours:7.2f}x")
            same = all(w_ours[k] == w_base[k] for k in ("value_low", "value_high", "nodes"))
            print(f"{'whole game: certified interval':44} [{w_base['value_low']:.5f}, {w_base['value_high']:.5f}] "
                  f"[{w_ours['value_low']:.5f}, {w_ours['value_high']:.5f}] {'same' if same else 'DIFFER':>8}")
        print(f"\n{load()} at the end")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(old.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
