"""Sticky routing benchmark: prefill tokens two real inference servers compute, with and without stickiness.

Run: python bench/bench_sticky.py [--groups 12] [--group-size 4] [--concurrency 8] [--no-cache]

Two `llama_cpp.server` processes on 127.0.0.1 serve the embedded GGUF (SmolLM2-135M,
one thread each, `--cache True`: a RAM prefix cache, as vLLM's and SGLang's automatic
prefix caching), and the server pool plays the same groups (same deals, same sampling
seeds) twice: least-loaded routing, then sticky routing. Each mode gets freshly started
servers, so neither inherits the other's cache. Decoding is constrained to valid calls
(`json_object`), so episodes go on for several turns, whose prompts extend the earlier ones.

Measured, per mode:
  - prefill tokens computed: the sum of llama.cpp's own `prompt eval ... / N tokens`
    lines in each server's log (one per request: the tokens it evaluated, i.e. the prompt
    minus what its cache already held);
  - requests, and wall time of the whole run.
llama-cpp-python's server ignores `n`, so a group's answers are separate requests with
one shared prompt: least-loaded routing spreads them over both servers, sticky routing
sends them to one. Wall time on a shared machine is noisy; the token counts are not.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mock_openai_server import free_port  # noqa: E402

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import opening_messages  # noqa: E402
from blackjack_rl.rollout.groups import play_group  # noqa: E402
from blackjack_rl.rollout.players import Player  # noqa: E402
from blackjack_rl.policies.structured import structured_output_fields  # noqa: E402
from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy  # noqa: E402
from blackjack_rl.policies.pool import ServerPool, ServerSpec  # noqa: E402
from blackjack_rl.policies.sampling import Sampling  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.contract.tokens import ChatFormat, LlamaCppTokenizer, embedded_model_path  # noqa: E402

PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*[\d.]+ ms /\s*(\d+) tokens")


class LlamaServer:
    """One `python -m llama_cpp.server` on 127.0.0.1, verbose, its stderr in a log file."""

    def __init__(self, gguf: Path, log: Path, cache: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "blackjack_rl.policies.llama_server", "--model", str(gguf), "--host", "127.0.0.1",
                 "--port", str(self.port), "--n_ctx", "2048", "--n_threads", "1", "--verbose", "True",
                 "--cache", str(cache), "--model_alias", "smollm2"],
                stdout=fh, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("llama_cpp.server did not come up in 120 s")

    def prefill_tokens(self) -> tuple[int, int]:
        """(tokens evaluated as prompt, requests), from llama.cpp's per-request perf lines."""
        counts = [int(m.group(1)) for m in PROMPT_EVAL.finditer(self.log.read_text(errors="replace"))]
        return sum(counts), len(counts)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def shared_prefix(chat: ChatFormat) -> int:
    """Tokens every opening prompt shares (the system prompt and tool schema): every server caches them once."""
    a, b = (chat.prompt_ids(opening_messages(obs)) for obs in ((12, 2, False), (20, 10, True)))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def run_mode(sticky: bool, args: argparse.Namespace, chat: ChatFormat, gguf: Path, tmp: Path) -> dict:
    servers = [LlamaServer(gguf, tmp / f"{'sticky' if sticky else 'plain'}-{i}.log", args.cache) for i in range(2)]
    try:
        pool = ServerPool([ServerSpec(s.url) for s in servers], timeout=300, retries=1, sticky=sticky,
                          max_concurrency=args.concurrency)
        policy = OpenAICompletionsPolicy(pool, "smollm2", chat, token_path="chat",
                                         sampling=Sampling(temperature=1.0, max_tokens=args.max_tokens),
                                         extra_body=structured_output_fields("json_object"))
        player = Player(policy, chat, solve(Rules()))

        async def main():
            try:
                limiter = asyncio.Semaphore(args.concurrency)
                t0 = time.perf_counter()
                results = await asyncio.gather(*(play_group(player, 1000 + seed, GroupConfig(group_size=args.group_size), limiter=limiter)
                                                 for seed in range(args.groups)))
                return results, time.perf_counter() - t0, pool.snapshot()
            finally:
                await policy.aclose()

        results, seconds, snapshot = asyncio.run(main())
    finally:
        for s in servers:
            s.stop()
    per_server = [s.prefill_tokens() for s in servers]
    episodes = [ep for r in results for ep in r.episodes]
    return {
        "sticky": sticky,
        "seconds": seconds,
        "prefill_tokens": sum(t for t, _ in per_server),
        "requests": sum(n for _, n in per_server),
        "per_server": per_server,
        "episodes": len(episodes),
        "failed": sum(ep.failed for ep in episodes),
        "decisions": sum(len(ep.decisions) for ep in episodes),
        "spilled": sum(s["sticky_spilled_in"] for s in snapshot),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="servers without the RAM prefix cache (only the last request's KV is reused)")
    parser.add_argument("--logs", metavar="DIR", help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args()
    gguf = Path(embedded_model_path())
    chat = ChatFormat.learn(LlamaCppTokenizer.from_gguf(str(gguf)))
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        rows = [run_mode(False, args, chat, gguf, logs), run_mode(True, args, chat, gguf, logs)]
    print(f"{args.groups} groups x {args.group_size}, {args.concurrency} episodes in flight, two llama_cpp.server "
          f"(1 thread each, prefix cache {'on' if args.cache else 'off'}), constrained to valid calls")
    shared = shared_prefix(chat)
    print(f"{'routing':<14}{'prefill tokens':>16}{'beyond shared':>15}{'requests':>10}{'decisions':>11}{'failed':>8}"
          f"{'wall s':>9}   per server (tokens, requests)")
    for r in rows:
        # the shared prefix is computed once on each server that got any request, whatever the routing
        r["beyond_shared"] = r["prefill_tokens"] - shared * sum(n > 0 for _, n in r["per_server"])
        print(f"{'sticky' if r['sticky'] else 'least-loaded':<14}{r['prefill_tokens']:>16}{r['beyond_shared']:>15}"
              f"{r['requests']:>10}{r['decisions']:>11}{r['failed']:>8}{r['seconds']:>9.1f}   {r['per_server']}")
    plain, sticky = rows
    if plain["prefill_tokens"] and plain["beyond_shared"]:
        print(f"sticky / least-loaded: prefill tokens x{sticky['prefill_tokens'] / plain['prefill_tokens']:.2f} "
              f"(beyond the {shared}-token shared prefix x{sticky['beyond_shared'] / plain['beyond_shared']:.2f}), "
              f"wall time x{sticky['seconds'] / plain['seconds']:.2f}")


if __name__ == "__main__":
    main()
