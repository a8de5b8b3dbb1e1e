"""The OpenAI-compatible server policy against llama.cpp's real server serving the embedded GGUF."""

import asyncio
import time

import pytest

from blackjack_rl.episode import play_episode
from blackjack_rl.game import Rules, Table
from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
from blackjack_rl.tokens import ChatFormat, HFTokenizer, trained_spans
from conftest import free_port

pytestmark = pytest.mark.embedded


def test_episodes_through_a_real_chat_server(llama_server, hf_tokenizer_dir, solution):
    chat = ChatFormat.learn(HFTokenizer(str(hf_tokenizer_dir)))
    policy = OpenAIChatPolicy(llama_server, "smollm2", max_tokens=32, temperature=1.0, timeout=60)

    async def main():
        try:
            return [await play_episode(Table(Rules()), policy, chat, solution, seed) for seed in range(3)]
        finally:
            await policy.aclose()

    for ep in asyncio.run(main()):
        assert ep.status in ("finished", "invalid", "truncated"), ep.error
        spans = trained_spans(ep.trajectory.masks)
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert len(spans) == len(answers) >= 1
        for (a, b), answer in zip(spans, answers):
            assert chat.backend.decode(ep.trajectory.tokens[a:b]) == answer + "<|im_end|>"


def test_unreachable_server_is_an_inference_failure_not_a_result(solution, vocab_chat):
    policy = OpenAIChatPolicy(f"http://127.0.0.1:{free_port()}/v1", "m", retries=1, timeout=2)

    async def main():
        try:
            return await play_episode(Table(), policy, vocab_chat, solution, 0)
        finally:
            await policy.aclose()

    ep = asyncio.run(main())
    assert ep.status == "failed" and ep.score is None and "2 attempts" in ep.error


def test_client_errors_are_not_retried(llama_server):
    policy = OpenAIChatPolicy(llama_server + "/missing", "smollm2", retries=3, max_tokens=4)  # a 404

    async def main():
        try:
            t0 = time.monotonic()
            with pytest.raises(InferenceError, match="refused the request: HTTP 4"):
                await policy.respond(Turn([{"role": "user", "content": "hi"}], [], None, False, 0))
            return time.monotonic() - t0
        finally:
            await policy.aclose()

    assert asyncio.run(main()) < 5  # no backoff loop
