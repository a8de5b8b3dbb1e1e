"""The main job beside busy processes: how much slower does it get under CPU contention?

Runs the main job, `blackjack-rl evaluate` on the embedded model, first as it is and then
beside `--busy` processes that each keep one core busy, and prints both times and their
ratio. llama.cpp's threads wait for each other by spinning, so with more threads than free
cores the job collapsed (68 s on 2 idle cores, 28 minutes at load ~7: 25x). With its threads
matched to the free cores (policies/threads.py) the slowdown should stay near the share
of the CPU the job loses: on 2 cores beside 2 busy processes it gets 2/3 of a core, so
about 3x.

`--threads N` runs both phases with a fixed thread count instead (`--threads 2` on 2 cores
is the old behaviour), for a before/after. The load average and the cores other processes
kept busy are printed before each phase: the first phase is only idle if the machine is.

    python bench/bench_contention.py --deals 100
    python bench/bench_contention.py --deals 20 --threads 2     # the old thread choice
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from blackjack_rl.threads import _busy_seconds, usable_cpus


def others_busy(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next `seconds` (this process sleeps)."""
    cpus = set(os.sched_getaffinity(0))
    before = _busy_seconds(cpus)
    time.sleep(seconds)
    after = _busy_seconds(cpus)
    return (after - before) / seconds if before is not None and after is not None else float("nan")


def main_job(deals: int, threads: int | None, out: str) -> float:
    cmd = [sys.executable, "-m", "blackjack_rl.cli", "evaluate", "--episodes", str(deals), "--out", out, "--quiet"]
    if threads:
        cmd += ["--threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the main job failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return seconds


def phase(name: str, deals: int, threads: int | None, busy: int, out: str) -> float:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0.0)  # let them start
        load = os.getloadavg()[0]
        print(f"{name}: load average {load:.2f}, other processes keep {others_busy():.2f} of "
              f"{usable_cpus()} cores busy; {busy} busy processes of ours", flush=True)
        seconds = main_job(deals, threads, out)
    finally:
        for hog in hogs:  # only the processes started here, by their PIDs
            hog.kill()
            hog.wait()
    print(f"{name}: {deals} deals in {seconds:.1f} s", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deals", type=int, default=100, help="evaluation deals per run (default 100, the main job)")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the job (default 2)")
    parser.add_argument("--threads", type=int, help="a fixed llama.cpp thread count (default: the job's own choice)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as tmp:
        alone = phase("alone", args.deals, args.threads, 0, os.path.join(tmp, "alone"))
        beside = phase(f"beside {args.busy} busy", args.deals, args.threads, args.busy, os.path.join(tmp, "busy"))
    mode = f"{args.threads} fixed threads" if args.threads else "threads matched to free cores"
    print(f"slowdown beside {args.busy} busy processes ({mode}): {beside / alone:.2f}x "
          f"({alone:.1f} s -> {beside:.1f} s); aim: at most 3x on 2 cores")


if __name__ == "__main__":
    main()
