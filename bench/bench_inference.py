"""Inference benchmark: what the environment costs per episode when a server does the sampling.

Run: python bench/bench_inference.py [--episodes 2000] [--group-size 16] [--profile]

The server is the vLLM mock from tests/ (its minimal asyncio HTTP layer) in its own
process, answering instantly (or after a fixed latency), so the CPU measured here (`time.process_time` of this process)
is our code alone: HTTP client, JSON, token ids, the game, parsing, scoring, packing.
Each number is printed next to baselines measured in the same run:
  - `chat client`: the existing single-client chat-completions policy
    (the answer comes back as text and is re-tokenized);
  - `naive`: the pattern of the Atropos original: a new HTTP client per request and the
    whole conversation re-rendered through the chat template every turn.
Measured:
  1. CPU ms per episode (target < 1.5; the original needs ~17) and episodes per second,
     playing groups of 16 (the pool's path shares the first turn: one request with n=16);
  2. wall time of an evaluation of 100 episodes at 50 ms server latency (target < 1 s;
     the original, one episode at a time, takes 15.5 s), against one-at-a-time here and
     against the floor: the same episodes with every answer an in-process 50 ms sleep.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mock_openai_server import MockServer, blackjack_answers, write_config  # noqa: E402

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.runner import run_evaluation  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.rollout.groups import play_group  # noqa: E402
from blackjack_rl.rollout.players import Player  # noqa: E402
from blackjack_rl.policies.base import Reply, Turn  # noqa: E402
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy  # noqa: E402
from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy  # noqa: E402
from blackjack_rl.policies.pool import ServerPool, ServerSpec  # noqa: E402
from blackjack_rl.policies.sampling import Sampling  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402
from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer, LlamaCppTokenizer, embedded_model_path  # noqa: E402


class NaivePolicy:
    """The Atropos pattern, for comparison: a client per request, the template re-rendered per turn."""

    name = "naive"

    def __init__(self, base_url: str, model: str, chat: ChatFormat, max_tokens: int) -> None:
        self.base_url, self.model, self.chat, self.max_tokens = base_url, model, chat, max_tokens

    def generation_params(self) -> dict[str, Any]:
        return {"policy": "naive"}

    async def respond(self, turn: Turn) -> Reply:
        # what the original does each turn: render and tokenize the whole conversation
        self.chat.backend.encode(self.chat.backend.render(turn.messages, add_generation_prompt=True))
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as client:
            r = await client.post("/chat/completions", json={
                "model": self.model, "messages": list(turn.messages), "max_tokens": self.max_tokens,
                "temperature": 1.0, "seed": turn.seed & 0x7FFFFFFF, "n": 1})
        return Reply(text=r.json()["choices"][0]["message"]["content"])

    async def aclose(self) -> None:
        pass


def make_chat(kind: str) -> ChatFormat:
    if kind == "hf":
        from gguf_tokenizer import build_hf_tokenizer

        folder = build_hf_tokenizer(embedded_model_path(), Path(tempfile.mkdtemp(prefix="bench-tok-")))
        return ChatFormat.learn(HFTokenizer(str(folder)))
    return ChatFormat.learn(LlamaCppTokenizer.from_gguf(embedded_model_path()))


async def play_groups(player: Player, n_groups: int, group_size: int, concurrency: int) -> int:
    limiter = asyncio.Semaphore(concurrency)
    window = max(1, concurrency // group_size) + 1
    played = failed = 0
    pending: list[asyncio.Task] = []
    seed = 0
    while seed < n_groups or pending:
        while seed < n_groups and len(pending) < window:
            pending.append(asyncio.create_task(play_group(player, seed, GroupConfig(group_size=group_size), limiter=limiter)))
            seed += 1
        result = await pending.pop(0)
        played += len(result.episodes)
        failed += sum(ep.failed for ep in result.episodes)
    if failed:
        raise RuntimeError(f"{failed} episodes failed in the benchmark; is the mock server up?")
    return played


def measure(make_policy: Callable[[], Any], chat: ChatFormat, solution, episodes: int, group_size: int,
            profile: bool = False) -> tuple[float, float]:
    """(CPU ms per episode, episodes per second) for groups played through `make_policy()`."""
    async def main() -> tuple[float, float, int]:
        policy = make_policy()
        player = Player(policy, chat, solution)
        try:
            await play_groups(player, 4, group_size, 64)  # warm up: connections, caches, the probe
            prof = cProfile.Profile(time.process_time) if profile else None
            c0, w0 = time.process_time(), time.perf_counter()
            if prof:
                prof.enable()
            n = await play_groups(player, max(1, episodes // group_size), group_size, 64)
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return time.process_time() - c0, time.perf_counter() - w0, n
        finally:
            await policy.aclose()

    cpu, wall, n = asyncio.run(main())
    return 1000 * cpu / n, n / wall


def evaluation_wall(make_policy: Callable[[], Any], chat: ChatFormat, solution, episodes: int, concurrency: int) -> float:
    """Wall seconds of `run_evaluation`, after a warm-up that opens the connections a long run keeps."""
    async def main() -> float:
        policy = make_policy()
        player = Player(policy, chat, solution)
        try:
            await run_evaluation(player, concurrency, concurrency=concurrency)
            t0 = time.perf_counter()
            eps = await run_evaluation(player, episodes, concurrency=concurrency)
            wall = time.perf_counter() - t0
            if any(ep.failed for ep in eps):
                raise RuntimeError("episodes failed during the evaluation benchmark")
            return wall
        finally:
            await policy.aclose()

    return asyncio.run(main())


class SleepPolicy:
    """The floor for an evaluation's wall time: each answer takes exactly the latency, with no
    HTTP at all (answers drawn like the mock's, so episodes last as many turns)."""

    name = "sleep"

    def __init__(self, chat: ChatFormat, answers: list[dict[str, Any]], latency_s: float) -> None:
        self.chat, self.answers, self.latency_s = chat, answers, latency_s
        self.weights = [a["weight"] for a in answers]

    def generation_params(self) -> dict[str, Any]:
        return {"policy": "sleep"}

    async def respond(self, turn: Turn) -> Reply:
        await asyncio.sleep(self.latency_s)
        answer = random.Random(turn.seed).choices(self.answers, self.weights)[0]
        ids = list(answer["ids"])
        closed = ids[-1:] == self.chat.end_of_turn_ids
        return Reply(text=answer["text"], completion_ids=ids, logprobs=[0.0] * len(ids),
                     finish_reason="stop" if closed else "length")

    async def aclose(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2000, help="episodes per CPU measurement (default 2000)")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--latency-ms", type=float, default=50.0, help="server latency for the evaluation timing")
    parser.add_argument("--tokenizer", choices=["hf", "gguf"], default="hf",
                        help="hf: a Hugging Face tokenizer as for real servers (default); gguf: llama.cpp's vocabulary")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the pool's run")
    args = parser.parse_args()

    chat = make_chat(args.tokenizer)
    solution = solve(Rules())
    cfg = write_config(Path(tempfile.mkdtemp(prefix="bench-mock-")) / "answers.json", blackjack_answers(chat),
                       chat.end_of_turn_ids[0])
    server = MockServer(cfg, raw=True)
    try:
        server.control(record=False)

        def pool_policy(**pool_args: Any) -> OpenAICompletionsPolicy:
            return OpenAICompletionsPolicy(ServerPool([ServerSpec(server.url)], timeout=30, **pool_args),
                                           "mock", chat, sampling=Sampling(max_tokens=64))

        def chat_policy() -> OpenAIChatPolicy:
            return OpenAIChatPolicy(server.url, "mock", sampling=Sampling(max_tokens=64), timeout=30)

        def naive_policy() -> NaivePolicy:
            return NaivePolicy(server.url, "mock", chat, 64)

        print(f"# Inference benchmark: instant vLLM mock on 127.0.0.1, groups of {args.group_size}, "
              f"{args.episodes} episodes per run, {args.tokenizer} tokenizer\n")
        rows = []
        for label, make in (("pool, token ids, shared first turn", pool_policy),
                            ("chat client (baseline)", chat_policy),
                            ("naive: client per request, re-render (baseline)", naive_policy)):
            ms, eps = measure(make, chat, solution, args.episodes, args.group_size, args.profile and make is pool_policy)
            rows.append((label, ms, eps))
        ours_ms, ours_eps = rows[0][1], rows[0][2]
        print(f"{'':50} {'CPU ms/episode':>15} {'episodes/s':>11} {'CPU vs ours':>12}")
        for label, ms, eps in rows:
            print(f"{label:50} {ms:15.3f} {eps:11.0f} {ms / ours_ms:11.1f}x")
        print(f"\nCPU per episode, ours: {ours_ms:.3f} ms (target < 1.5 ms; the Atropos original ~17 ms) "
              f"-> {'PASS' if ours_ms < 1.5 else 'FAIL'}")
        print(f"episodes/s with group size {args.group_size}: {ours_eps:.0f} "
              "(bounded by the mock server sharing these CPUs)")

        server.control(latency_ms=args.latency_ms)
        answers, latency = blackjack_answers(chat), args.latency_ms / 1000
        print(f"\nevaluation of {args.eval_episodes} episodes at {args.latency_ms:g} ms server latency "
              "(target < 1 s; the original, one at a time, takes 15.5 s):")
        print(f"{'concurrency':>12} {'ours, s':>9} {'floor, s':>9} {'one at a time, s':>17}")
        serial = evaluation_wall(pool_policy, chat, solution, args.eval_episodes, 1)
        for concurrency in (64, 128):
            ours = evaluation_wall(pool_policy, chat, solution, args.eval_episodes, concurrency)
            floor = evaluation_wall(lambda: SleepPolicy(chat, answers, latency), chat, solution,
                                    args.eval_episodes, concurrency)
            print(f"{concurrency:12d} {ours:9.2f} {floor:9.2f} {serial:17.2f}   "
                  f"{'PASS' if ours < 1.0 else 'FAIL'} ({ours / floor:.1f}x the floor, {serial / ours:.0f}x faster "
                  "than one at a time)")
        print("floor: the same episodes with each answer an in-process sleep of the latency, no HTTP")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
