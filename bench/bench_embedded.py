"""The main job on the embedded model, against a baseline run side by side, and its token rates
against raw llama.cpp.

Run alone on the machine (llama.cpp's numbers mean nothing beside other CPU work):

    python bench/bench_embedded.py [--deals 100] [--baseline REV] [--prompts 24]

1. `blackjack-rl evaluate --episodes N` (the README's first command, the whole process) with the
   working tree and with this project at `--baseline` (bench/baseline.py), one after the other;
   both must report the same mean reward and invalid rate (same seeds, same answers).
2. Prefill and decode tokens/s on the opening prompts of the first `--prompts` deals:
   - raw llama.cpp: a model of its own with the logits of the last position only, `Llama.eval`
     of each whole prompt from an empty cache, then the tokens the policy sampled decoded one at
     a time, one sequence at a time (no sampling, so raw pays nothing but llama.cpp's own work);
   - ours: the policy answering all prompts at once (shared prefixes reused, sequences decoded
     together), as the main job does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline  # noqa: E402
from baseline import load  # noqa: E402

# The last commit before the embedded policy decoded several sequences at once.
DEFAULT_REV = "ee2b82a"


# A baseline from before policies/llama_load.py crashes on CPUs with AMX (llama.cpp issue
# 20824); it runs inside that module's `plain_cpu_buffers`, taken from this checkout by path.
PLAIN_BUFFERS = f"""
import runpy, sys
plain = runpy.run_path({str(baseline.ROOT / "src/blackjack_rl/policies/llama_load.py")!r})["plain_cpu_buffers"]
with plain():
    sys.argv[0] = "blackjack-rl"
    runpy.run_module("blackjack_rl.cli", run_name="__main__")
"""


def main_job(src: Path | None, deals: int, out: Path) -> tuple[float, dict]:
    head = ["-m", "blackjack_rl.cli"] if src is None else ["-c", PLAIN_BUFFERS]
    cmd = [sys.executable, *head, "evaluate", "--episodes", str(deals), "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=baseline.cli_env(src), check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / "metrics.json").read_text())


def token_rates(n_prompts: int) -> None:
    from blackjack_rl.rollout.episodes import opening_messages
    from blackjack_rl.game.table import Rules, Table
    from blackjack_rl.policies.base import Turn
    from blackjack_rl.policies.embedded import EmbeddedPolicy
    from blackjack_rl.policies.llama_load import load_llama
    from blackjack_rl.policies.sampling import Sampling
    from blackjack_rl.threads import usable_cpus

    policy = EmbeddedPolicy(sampling=Sampling(temperature=1.0), n_ctx=1024, n_threads=usable_cpus())
    table = Table(Rules())
    prompts = [policy.chat.prompt_ids(opening_messages(table.reset(seed))) for seed in range(n_prompts)]

    async def ours():
        return await asyncio.gather(*(policy.respond(Turn([], p, None, False, seed)) for seed, p in enumerate(prompts)))

    t0 = time.perf_counter()
    replies = asyncio.run(ours())
    wall_ours = time.perf_counter() - t0
    sampled = [len(r.completion_ids) for r in replies]

    # Raw llama.cpp as its own tools run it: a fresh context per prompt, logits of the last
    # position only, and decoding the tokens ours sampled one at a time (no sampling cost at all).
    # It runs on the policy's own llama.cpp thread: from a second thread of the same process
    # llama.cpp decodes ~3x slower (docs/inference.md, "One llama.cpp thread per process").
    raw = load_llama(model_path=str(policy.model_path), n_ctx=1024, n_threads=usable_cpus(),
                     n_threads_batch=usable_cpus(), verbose=False)

    def measure_raw() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        for p in prompts:
            raw.reset()
            raw.eval(p)
        prefill_s = time.perf_counter() - t0
        decode_s, n_decoded = 0.0, 0
        for p, r in zip(prompts, replies):
            raw.reset()
            raw.eval(p)
            t0 = time.perf_counter()
            for tok in r.completion_ids[:-1]:
                raw.eval([tok])
            decode_s += time.perf_counter() - t0
            n_decoded += len(r.completion_ids) - 1
        return prefill_s, decode_s, n_decoded

    prefill_s, decode_s, n_decoded = policy._worker.submit(measure_raw).result()
    n_prompt, n_new = sum(map(len, prompts)), sum(sampled)
    raw_s = prefill_s + decode_s * n_new / n_decoded
    print(f"\n[tokens/s] {n_prompts} opening prompts ({n_prompt} prompt tokens), {n_new} sampled tokens | {load()}")
    print(f"  raw llama.cpp, one sequence at a time: prefill {n_prompt / prefill_s:7.0f} tok/s   "
          f"decode {n_decoded / decode_s:6.0f} tok/s   together {raw_s:6.2f} s")
    print(f"  ours (prefix reuse, {policy.parallel} sequences a decode): {wall_ours:6.2f} s for both, "
          f"{n_new / wall_ours:6.0f} sampled tok/s   x{raw_s / wall_ours:.2f} faster than raw")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deals", type=int, default=100)
    parser.add_argument("--baseline", default=DEFAULT_REV, help="the commit to compare against")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--skip-job", action="store_true", help="only the token rates")
    args = parser.parse_args(argv)
    if not args.skip_job:
        old = baseline.unpack(args.baseline)
        baseline.check_source(old)
        baseline.check_source(None)
        work = Path(tempfile.mkdtemp(prefix="bench-embedded-"))
        results = {}
        for name, src in (("ours", None), (f"baseline {args.baseline}", old)):
            print(f"[main job] {name}: evaluate --episodes {args.deals} ... ({load()})", flush=True)
            results[name] = main_job(src, args.deals, work / name.replace(" ", "-"))
            wall, m = results[name]
            print(f"  {wall:6.1f} s   mean reward {m['mean_reward']['mean']:+.4f}   "
                  f"invalid {m['invalid']['rate']:.3f}", flush=True)
        (w_ours, m_ours), (w_base, m_base) = results.values()
        same = m_ours["mean_reward"] == m_base["mean_reward"] and m_ours["invalid"] == m_base["invalid"]
        print(f"  baseline / ours: x{w_base / w_ours:.2f}   same results: {'yes' if same else 'NO'}")
    token_rates(args.prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
