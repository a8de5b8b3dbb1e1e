"""Adapter benchmark: the CPU cost per step of each trainer adapter against our own loops.

Run: python bench/bench_adapters.py [--episodes 3000]

Every adapter plays the same deals with the same answers (the optimal action as a
`take_action` call), in-process, so only the adapter's own translation is measured:
  - baseline: `BlackjackEnv` reset/step, the one game loop every adapter wraps;
  - our episode loop: `play_episode` with the optimal bot (prompt tokens, trajectory, scoring);
  - each adapter: its reset and step entry points as its library calls them (OpenEnv's
    server-side `Environment`, TRL's `take_action` plus the reward function, verifiers'
    `setup_state` / `env_response` / rubric), without any network or model.
Ratios are against the baseline measured in the same run (these machines are shared and noisy).
An adapter whose extra is not installed is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from blackjack_rl.env import BlackjackEnv, solution_for
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.contract.protocol import tool_call_text

SOLUTION = solution_for(Rules())


def answer_for(env: BlackjackEnv) -> str:
    return tool_call_text(SOLUTION.best_action(env.observation, env.natural))


def play_all(seeds: range, reset: Callable[[int], BlackjackEnv], step: Callable[[str], bool]) -> int:
    """Deal every seed with `reset` (which returns the env underneath) and answer optimally until `step` says done."""
    steps = 0
    for seed in seeds:
        env, done = reset(seed), False
        while not done:
            done, steps = step(answer_for(env)), steps + 1
    return steps


def core(seeds: range) -> int:
    env = BlackjackEnv(SOLUTION)

    def step(answer: str) -> bool:
        _, _, terminated, truncated, _ = env.step(answer)
        return terminated or truncated

    return play_all(seeds, lambda seed: env.reset(seed) and env, step)


def episode_loop(seeds: range) -> int:
    from blackjack_rl.rollout.episodes import play_episode
    from blackjack_rl.policies.bots import OptimalBot
    from blackjack_rl.contract.tokens import ChatFormat, LlamaCppTokenizer, embedded_model_path

    chat = ChatFormat.learn(LlamaCppTokenizer.from_gguf(embedded_model_path()))
    table, bot = Table(Rules()), OptimalBot(SOLUTION)

    async def run() -> int:
        return sum([len((await play_episode(table, bot, chat, SOLUTION, seed)).decisions) for seed in seeds])

    return asyncio.run(run())


def gymnasium_adapter(seeds: range) -> int:
    import gymnasium

    import blackjack_rl.adapters  # noqa: F401

    env = gymnasium.make("blackjack_rl/BlackjackText-v0")

    def step(answer: str) -> bool:
        _, _, terminated, truncated, _ = env.step(answer)
        return terminated or truncated

    return play_all(seeds, lambda seed: env.reset(seed=seed) and env.unwrapped.env, step)


def skyrl_adapter(seeds: range) -> int:
    import skyrl_gym

    import blackjack_rl.adapters.skyrl_env  # noqa: F401

    current = []

    def reset(seed: int) -> BlackjackEnv:
        current[:] = [skyrl_gym.make("blackjack_rl", env_config={}, extras={"seed": seed})]  # one per trajectory
        current[0].init(None)
        return current[0].env

    return play_all(seeds, reset, lambda answer: current[0].step(answer)["done"])


def openenv_adapter(seeds: range) -> int:
    from blackjack_rl.adapters.openenv import BlackjackAction, BlackjackEnvironment

    env = BlackjackEnvironment()
    return play_all(seeds, lambda seed: env.reset(seed=seed) and env.env,
                    lambda answer: env.step(BlackjackAction(answer=answer)).done)


def trl_adapter(seeds: range) -> int:
    from blackjack_rl.adapters.trl_env import BlackjackTRLEnv, blackjack_reward

    env, steps = BlackjackTRLEnv(), 0
    for seed in seeds:
        env.reset(seed=seed)
        while not env.env.done:
            best = SOLUTION.best_action(env.env.observation, env.env.natural)
            env.take_action("hit" if best == 1 else "stick")
            steps += 1
        blackjack_reward([[]], [env])
    return steps


def verifiers_adapter(seeds: range) -> int:
    from blackjack_rl.adapters.verifiers_env import load_environment

    vf_env = load_environment(num_train_deals=1, num_eval_deals=1)

    async def run() -> int:
        steps = 0
        for seed in seeds:
            state = {"info": {"seed": seed}}
            await vf_env.setup_state(state)
            env = state["blackjack_env"]
            messages: list[dict] = []
            while state.get("final_env_response") is None:
                messages.append({"role": "assistant", "content": answer_for(env)})
                await vf_env.env_response(messages, state)
                steps += 1
            await vf_env.episode_score(state)
        return steps

    return asyncio.run(run())


def measure(fn: Callable[[range], int], seeds: range) -> tuple[float, int]:
    fn(range(20))  # imports and first-use costs stay out of the measurement
    t0 = time.process_time()
    steps = fn(seeds)
    return (time.process_time() - t0) / steps, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=3000)
    args = parser.parse_args()
    seeds = range(1000, 1000 + args.episodes)
    base, steps = measure(core, seeds)
    print(f"{args.episodes} episodes, {steps} steps each run; CPU per step")
    print(f"{'BlackjackEnv (baseline)':<28} {base * 1e6:8.1f} us   1.00x")
    for name, fn in [("our episode loop (tokens)", episode_loop), ("Gymnasium", gymnasium_adapter),
                     ("SkyRL-gym", skyrl_adapter), ("OpenEnv (in-process)", openenv_adapter),
                     ("TRL", trl_adapter), ("verifiers", verifiers_adapter)]:
        try:
            per_step, n = measure(fn, seeds)
        except ImportError as exc:
            print(f"{name:<28} skipped: {exc.name} is not installed")
            continue
        assert n == steps, f"{name} played {n} steps, the baseline {steps}: not the same games"
        print(f"{name:<28} {per_step * 1e6:8.1f} us   {per_step / base:.2f}x")


if __name__ == "__main__":
    main()
