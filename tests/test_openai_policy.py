"""The OpenAI-compatible chat policy: against llama.cpp's real server serving the embedded GGUF, and
against a real HTTP server that gives answers of odd shapes (directly and through the server pool)."""

import asyncio
import json
import subprocess

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy
from blackjack_rl.policies.pool import ServerPool, ServerSpec
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.contract.protocol import HIT, tool_call_text
from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer, trained_spans
from canned_server import CannedServer, chat_answer
from helpers import CLI, free_port

@pytest.mark.embedded
def test_episodes_through_a_real_chat_server(llama_server, hf_tokenizer_dir, solution):
    chat = ChatFormat.learn(HFTokenizer(str(hf_tokenizer_dir)))
    policy = OpenAIChatPolicy(llama_server, "smollm2", sampling=Sampling(temperature=1.0, max_tokens=32), timeout=60)

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


@pytest.mark.parametrize("status", [400, 404, 422])
def test_client_errors_are_not_retried(status):
    """Counted, not timed: a 4xx is asked once, however many retries are allowed."""
    with CannedServer({"error": {"message": "no such route"}}, status=status) as server:
        policy = OpenAIChatPolicy(server.url, "m", retries=3, sampling=Sampling(max_tokens=4))

        async def main():
            try:
                with pytest.raises(InferenceError, match=f"refused the request: HTTP {status}"):
                    await policy.respond(Turn([{"role": "user", "content": "hi"}], [], None, False, 0))
            finally:
                await policy.aclose()

        asyncio.run(asyncio.wait_for(main(), 60))
        assert server.posts == 1


# -- answers of odd shapes: text when they can be read as text, else a failed episode ---------

CALL = tool_call_text(HIT)
READABLE = {
    "content parts": {"role": "assistant", "content": [{"type": "text", "text": CALL}]},
    "split content parts": {"role": "assistant", "content": [{"type": "text", "text": CALL[:9]}, CALL[9:]]},
    "output_text part": {"role": "assistant", "content": [{"type": "output_text", "text": CALL, "annotations": []}]},
    "null content with a native call": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "take_action", "arguments": '{"action": "hit"}'}}]},
}
# answers that are an invalid move, not a failure: the model's call was readable but wrong
INVALID = {
    "a call whose function is a string": {"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]},
    "a call with arguments of the wrong type": {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "take_action", "arguments": 7}}]},
}
UNREADABLE = {
    "content is a dict": {"role": "assistant", "content": {"type": "text", "text": CALL}},
    "content is a number": {"role": "assistant", "content": 42},
    "content is true": {"role": "assistant", "content": True},
    "content is null": {"role": "assistant", "content": None},
    "a part without text": {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    "a part that is a number": {"role": "assistant", "content": [1, 2]},
    "a part whose text is a list": {"role": "assistant", "content": [{"type": "text", "text": ["a"]}]},
    "tool_calls is a string": {"role": "assistant", "content": "", "tool_calls": "take_action"},
    "tool_calls is a dict": {"role": "assistant", "content": None, "tool_calls": {"function": {"name": "x"}}},
    "a tool call that is a string": {"role": "assistant", "content": CALL, "tool_calls": ["take_action"]},
    "message is a string": CALL,
    "no message": None,
}
BODIES = {
    "no choices": {"id": "x"},
    "choices is a dict": {"choices": {"0": {"message": {"content": CALL}}}},
    "choices is empty": {"choices": []},
    "the answer is a list": [{"message": {"content": CALL}}],
    "the answer is a string": "hello",
    "a choice is a string": {"choices": ["hit"]},
}


def _unreadable_answers():
    answers = {name: chat_answer(message) for name, message in UNREADABLE.items()}
    answers["no message"] = {"choices": [{"index": 0, "finish_reason": "stop"}]}
    return {**answers, **BODIES}


def _play_one(policy, chat, solution, seed=1):
    async def main():
        try:
            return await play_episode(Table(Rules()), policy, chat, solution, seed)
        finally:
            await policy.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def _play_group(policy, chat, solution, size=4):
    async def main():
        try:
            return await play_group(Player(policy, chat, solution), 1, GroupConfig(group_size=size))
        finally:
            await policy.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def _direct(url):
    return OpenAIChatPolicy(url, "m", retries=0)


def _pooled(url, chat):
    return OpenAICompletionsPolicy(ServerPool([ServerSpec(url)], retries=0), "m", chat, token_path="chat")


def _played(answer, via, chat, solution):
    """One episode against a server that gives `answer`, directly or through the server pool."""
    with CannedServer(answer) as server:
        return _play_one(_direct(server.url) if via == "direct" else _pooled(server.url, chat), chat, solution)


@pytest.mark.parametrize("via", ["direct", "pool"])
@pytest.mark.parametrize("name", list(READABLE))
def test_content_parts_and_native_calls_are_read_as_text(name, via, vocab_chat, solution):
    ep = _played(chat_answer(READABLE[name]), via, vocab_chat, solution)
    assert not ep.failed, ep.error
    assert ep.decisions[0].action == "hit"
    assert all(isinstance(m["content"], str) for m in ep.messages)


@pytest.mark.parametrize("via", ["direct", "pool"])
def test_lone_surrogates_in_an_answer_are_replaced_not_a_crash(via, vocab_chat, solution):
    """The JSON escape \\ud800 alone is not text: UTF-8 (the tokenizer, the files) cannot encode it."""
    ep = _played(chat_answer({"role": "assistant", "content": "\ud800" + CALL + "\udfff"}), via, vocab_chat, solution)
    if ep.failed:  # orjson, when installed, refuses the escape for the pool: a reason, not a crash
        assert via == "pool" and "invalid JSON" in ep.error
    else:
        assert ep.decisions[0].action == "hit"
        assert ep.messages[2]["content"] == "\ufffd" + CALL + "\ufffd"


@pytest.mark.parametrize("via", ["direct", "pool"])
@pytest.mark.parametrize("name", list(INVALID))
def test_a_malformed_native_call_is_an_invalid_answer(name, via, vocab_chat, solution):
    ep = _played(chat_answer(INVALID[name]), via, vocab_chat, solution)
    assert ep.status == "invalid" and ep.score == -1.0 and ep.error is None


@pytest.mark.parametrize("via", ["direct", "pool", "pool group"])
@pytest.mark.parametrize("name", list(_unreadable_answers()))
def test_an_answer_of_the_wrong_shape_fails_the_episode_with_a_reason(name, via, vocab_chat, solution, caplog):
    with CannedServer(_unreadable_answers()[name]) as server:
        if via == "direct":
            episodes = [_play_one(_direct(server.url), vocab_chat, solution)]
        elif via == "pool":
            episodes = [_play_one(_pooled(server.url, vocab_chat), vocab_chat, solution)]
        else:  # the group's shared first turn (n answers in one request), then single requests
            result = _play_group(_pooled(server.url, vocab_chat), vocab_chat, solution)
            assert result.group is None and result.dropped == "failed_episodes"
            episodes = result.episodes
    for ep in episodes:
        assert ep.failed and ep.score is None and ep.outcome is None
        assert "answered" in ep.error and "Error" not in ep.error.split(":")[0]  # a reason, not an exception name
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]


def test_evaluate_reports_odd_answers_as_failures_without_a_traceback(tmp_path, gguf_path):
    """The whole command: episodes fail with the reason, the run ends with exit 3, no traceback."""
    with CannedServer(chat_answer({"role": "assistant", "content": {"text": CALL}})) as server:
        proc = subprocess.run(
            [*CLI, "evaluate", "--policy", "openai", "--base-url", server.url,
             "--model", "m", "--tokenizer", str(gguf_path), "--retries", "0", "--episodes", "3",
             "--out", str(tmp_path / "run"), "--quiet"],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["episodes_failed"] == 3 and "message.content" in metrics["failure_examples"][0]
