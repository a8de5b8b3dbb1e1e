"""Environment benchmark: our own cost per episode, evaluation throughput, embedded overhead.

Run: python bench/bench_env.py [--episodes 20000] [--embedded-episodes 12]

Everything is reported next to a baseline measured in the same run, because these
machines are shared and noisy:
  1. CPU per episode with a scripted bot (prompt, parse, tokens, solver scoring), against
     the bare Gymnasium loop playing the same deals with the same policy;
  2. wall time of `evaluate` for N episodes of the `optimal` and `random` bots, with the
     checks that the numbers are right (optimal within its CI of -0.04656, accuracy 1.0);
  3. the embedded model: our wall time against raw llama.cpp generating the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from blackjack_rl.config import load_settings
from blackjack_rl.rollout.episodes import play_episode
from blackjack_rl.measure.evaluation import compute_metrics
from blackjack_rl.rollout.runner import run_evaluation
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot
from blackjack_rl.rollout.players import build_player
from blackjack_rl.game.solver import solve


def bench_cpu_per_episode(n: int) -> None:
    player = build_player(load_settings(overrides={"policy": {"kind": "optimal"}}))
    solution, chat = player.solution, player.chat
    bot = OptimalBot(solution)
    table = Table(Rules())

    t0 = time.process_time()
    for seed in range(n):  # the baseline: Gymnasium alone, same deals, same decisions
        obs = table.reset(seed)
        while not (step := table.step(solution.best_action(obs, table.player_is_natural))).terminated:
            obs = step.observation
    raw = (time.process_time() - t0) / n

    async def ours() -> None:
        for seed in range(n):
            await play_episode(table, bot, chat, solution, seed)

    t0 = time.process_time()
    asyncio.run(ours())
    full = (time.process_time() - t0) / n
    print(f"[cpu/episode] bare gymnasium {raw * 1e3:.3f} ms | full episode (prompt, parse, tokens, scoring) "
          f"{full * 1e3:.3f} ms | ratio {full / raw:.2f}x | our own code {(full - raw) * 1e3:.3f} ms "
          f"(Atropos original: ~17 ms against an instant server)")


def bench_evaluate(n: int) -> None:
    for kind, expect in (("optimal", solve(Rules()).value), ("random", -0.3959)):
        player = build_player(load_settings(overrides={"policy": {"kind": kind}}))
        t0 = time.perf_counter()
        episodes = asyncio.run(run_evaluation(player, n, concurrency=256))
        wall = time.perf_counter() - t0
        m = compute_metrics(episodes, player)
        r = m["mean_reward"]
        inside = r["ci95_low"] <= expect <= r["ci95_high"]
        print(f"[evaluate {kind}] {n} episodes in {wall:.2f} s ({n / wall:,.0f} ep/s) | mean reward "
              f"{r['mean']:+.4f} [{r['ci95_low']:+.4f}, {r['ci95_high']:+.4f}] vs exact {expect:+.4f} "
              f"({'inside' if inside else 'OUTSIDE'} the CI) | decision accuracy {m['decision_accuracy']['rate']:.4f}")


def bench_embedded(n: int) -> None:
    player: Player = build_player(load_settings())
    policy = player.policy
    calls: list[tuple[list[int], int, int]] = []
    sample = policy._sample

    def recording(prompt_ids, seed):
        reply = sample(prompt_ids, seed)
        calls.append((list(prompt_ids), seed, len(reply.completion_ids)))
        return reply

    policy._sample = recording

    async def ours():
        return [await player.episode(seed) for seed in range(n)]

    policy.llama.reset()
    t0 = time.perf_counter()
    asyncio.run(ours())
    wall_ours = time.perf_counter() - t0

    llama = policy.llama  # the baseline: llama.cpp's own generate loop, same prompts, same token counts
    llama.reset()
    t0 = time.perf_counter()
    for prompt, seed, k in calls:
        llama.set_seed(seed & 0x7FFFFFFF)
        for i, _ in enumerate(llama.generate(prompt, temp=policy.temperature, top_p=1.0, top_k=0, min_p=0.0)):
            if i + 1 >= k:
                break
    wall_raw = time.perf_counter() - t0
    tokens = sum(k for _, _, k in calls)
    print(f"[embedded] {n} episodes, {len(calls)} model calls, {tokens} generated tokens | ours {wall_ours:.2f} s, "
          f"raw llama.cpp {wall_raw:.2f} s | ratio {wall_ours / wall_raw:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=20_000, help="bot evaluation episodes")
    ap.add_argument("--cpu-episodes", type=int, default=3_000)
    ap.add_argument("--embedded-episodes", type=int, default=12)
    args = ap.parse_args()
    bench_cpu_per_episode(args.cpu_episodes)
    bench_evaluate(args.episodes)
    if args.embedded_episodes:
        bench_embedded(args.embedded_episodes)


if __name__ == "__main__":
    main()
