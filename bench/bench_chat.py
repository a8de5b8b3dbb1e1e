"""Chat-path benchmark: `process` and `evaluate` with `--policy openai`, whole commands, against a baseline.

Run: python bench/bench_chat.py [--groups 4 36] [--baseline REV] [--profile]

The server is the OpenAI-compatible mock from tests/ (its minimal asyncio HTTP layer, its own
process), answering instantly or after a fixed latency; the tokenizer is SmolLM2's, as a Hugging
Face tokenizer folder (tests/gguf_tokenizer.py), as `--tokenizer DIR` is used with real servers.
Each command runs as a subprocess of `python -m blackjack_rl.cli`; its CPU is its own rusage
(os.wait4), so the mock's CPU is not counted. Rows, each next to the baseline (this project at
an earlier commit, see bench/baseline.py) measured in the same run:
  1. `process`: marginal CPU per episode: (CPU of the larger run - CPU of the smaller one) /
     the episodes between them, which cancels start-up; episodes/s likewise from wall time;
  2. `evaluate --episodes 100` at 50 ms server latency: the wall time of the whole command
     (start-up included: that is what a user waits for).
`--profile` then profiles one more `process` run of ours (top functions by own time).
"""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))

import baseline  # noqa: E402
from baseline import load  # noqa: E402
from gguf_tokenizer import build_hf_tokenizer  # noqa: E402
from mock_openai_server import MockServer, blackjack_answers, write_config  # noqa: E402

from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer, embedded_model_path  # noqa: E402

GROUP_SIZE = 16


def run_cli(src: Path | None, args: list[str], profile: Path | None = None) -> tuple[float, float]:
    """(wall s, CPU s) of one `blackjack-rl` command run from `src` (None: the working tree)."""
    head = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else []) + ["-m", "blackjack_rl.cli"]
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(head + args, env=baseline.cli_env(src), stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the mock server's
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{args[0]} exited {proc.returncode}: {err.read().decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs=2, default=[4, 36], metavar=("SMALL", "LARGE"),
                        help="groups of 16 in the two `process` runs (default 4 36)")
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--baseline", default=baseline.DEFAULT_REV, help="the commit to compare against")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of our larger process run")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    old = baseline.unpack(args.baseline)
    baseline.check_source(old)
    baseline.check_source(None)
    folder = build_hf_tokenizer(embedded_model_path(), work / "tokenizer")
    chat = ChatFormat.learn(HFTokenizer(str(folder)))
    cfg = write_config(work / "answers.json", blackjack_answers(chat), chat.end_of_turn_ids[0])
    server = MockServer(cfg, raw=True)
    sides = {"ours": None, f"baseline {args.baseline}": old}
    common = ["--policy", "openai", "--base-url", server.url, "--model", "mock", "--tokenizer", str(folder), "--quiet"]
    print(f"# Chat path: mock OpenAI server on 127.0.0.1, HF tokenizer folder, groups of {GROUP_SIZE}; "
          f"{os.cpu_count()} CPUs; {load()} at start\n")
    try:
        server.control(record=False)
        small, large = args.groups
        runs: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in sides}
        for groups in (small, large):
            for name, src in sides.items():  # interleaved, so both see the same load
                out = work / f"{name.split()[0]}-{groups}"
                runs[name][groups] = run_cli(src, ["process", *common, "--groups", str(groups), "--out", str(out)])
                print(f"  process --groups {groups:3d} [{name}]: {runs[name][groups][0]:.2f} s wall, "
                      f"{runs[name][groups][1]:.2f} s CPU ({load()})")
        episodes = (large - small) * GROUP_SIZE
        rows = {}
        for name in sides:
            (w1, c1), (w2, c2) = runs[name][small], runs[name][large]
            rows[name] = (1000 * (c2 - c1) / episodes, episodes / max(w2 - w1, 1e-9))

        server.control(latency_ms=args.latency_ms)
        evals = {}
        for name, src in sides.items():
            evals[name] = run_cli(src, ["evaluate", *common, "--episodes", str(args.eval_episodes),
                                        "--out", str(work / f"eval-{name.split()[0]}")])[0]
            print(f"  evaluate --episodes {args.eval_episodes} [{name}]: {evals[name]:.2f} s wall ({load()})")

        ours, base = rows["ours"], rows[f"baseline {args.baseline}"]
        print(f"\n{'row':58} {'baseline':>10} {'ours':>10} {'ratio':>8} {'goal':>8}")
        print(f"{'process: marginal CPU ms per episode':58} {base[0]:10.2f} {ours[0]:10.2f} "
              f"{base[0] / ours[0]:7.1f}x {'<= 1.5':>8}")
        print(f"{'process: episodes/s (marginal, same runs)':58} {base[1]:10.0f} {ours[1]:10.0f} "
              f"{ours[1] / base[1]:7.1f}x {'>= 600':>8}")
        e_base, e_ours = evals[f"baseline {args.baseline}"], evals["ours"]
        print(f"{f'evaluate {args.eval_episodes} episodes at {args.latency_ms:g} ms: wall s, whole command':58} "
              f"{e_base:10.2f} {e_ours:10.2f} {e_base / e_ours:7.1f}x {'<= 1.0':>8}")
        print(f"\n{load()} at the end; {episodes} marginal episodes per process row")
        if args.profile:  # a run of its own: the profiler's overhead stays out of the numbers above
            server.control(latency_ms=0)
            run_cli(None, ["process", *common, "--groups", str(large), "--out", str(work / "profiled")],
                    work / "ours.prof")
            print(f"\n# cProfile of our `process --groups {large}`, by own time")
            pstats.Stats(str(work / "ours.prof")).sort_stats("tottime").print_stats(30)
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(old.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
