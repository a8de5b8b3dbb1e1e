"""The chat policy's HTTP client (aiohttp): proxies from the environment, one session per event loop.

A CannedServer stands in for an HTTP proxy: a proxied request reaches it whatever host the URL
names, so an answer from a host that does not exist proves the proxy was used.
"""

from __future__ import annotations

import asyncio

import pytest

from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
from blackjack_rl.contract.protocol import HIT, tool_call_text
from canned_server import CannedServer, chat_answer

TURN = Turn([{"role": "user", "content": "hi"}], [], None, False, 0)
NOWHERE = "http://model.invalid/v1"  # .invalid never resolves (RFC 2606)


def _ask(policy: OpenAIChatPolicy):
    async def main():
        try:
            return await policy.respond(TURN)
        finally:
            await policy.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_requests_go_through_the_proxy_the_environment_names(monkeypatch):
    with CannedServer(chat_answer({"role": "assistant", "content": tool_call_text(HIT)})) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.removesuffix("/v1"))
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        reply = _ask(OpenAIChatPolicy(NOWHERE, "m", retries=0))
    assert reply.text == tool_call_text(HIT)
    assert proxy.posts == 1


def test_no_proxy_hosts_are_asked_directly(monkeypatch):
    with CannedServer(chat_answer({"role": "assistant", "content": "x"})) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.removesuffix("/v1"))
        monkeypatch.setenv("NO_PROXY", "model.invalid")
        with pytest.raises(InferenceError, match="1 attempts"):
            _ask(OpenAIChatPolicy(NOWHERE, "m", retries=0, timeout=5))
    assert proxy.posts == 0


def test_one_policy_serves_successive_event_loops():
    """The session is bound to the loop that opened it; a policy used again under a new loop opens another."""
    with CannedServer(chat_answer({"role": "assistant", "content": "x"})) as server:
        policy = OpenAIChatPolicy(server.url, "m", retries=0)
        assert asyncio.run(policy.respond(TURN)).text == "x"
        assert _ask(policy).text == "x"
    assert server.posts == 2
