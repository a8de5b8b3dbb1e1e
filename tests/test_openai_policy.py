"""The OpenAI-compatible server policy against llama.cpp's real server serving the embedded GGUF."""

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import pytest

from blackjack_rl.episode import play_episode
from blackjack_rl.game import Rules, Table
from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
from blackjack_rl.tokens import ChatFormat, HFTokenizer, trained_spans

pytestmark = pytest.mark.embedded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(gguf_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", "2048", "--verbose", "False", "--model_alias", "smollm2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError("llama_cpp.server did not come up in 60 s")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


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
    policy = OpenAIChatPolicy(f"http://127.0.0.1:{_free_port()}/v1", "m", retries=1, timeout=2)

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
