"""make_policy: every sampling setting reaches every policy that can honour it, the rest are
one-line errors; the retry loop every client shares; the one "n at once, else one by one"."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from blackjack_rl.config import Settings
from blackjack_rl.game.table import Observation
from blackjack_rl.policies import BuiltPolicy, check_supported, make_policy
from blackjack_rl.policies.base import InferenceError, Reply, Turn, answers_at_once
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.policies.structured import CALL_SCHEMA
from blackjack_rl.retry import RetriesExhausted, Retryable, RetryPolicy, retry_after_seconds, retry_async, retry_sync

from canned_server import CannedServer, chat_answer

CLI = [sys.executable, "-m", "blackjack_rl.cli"]
HIT_CALL = '<tool_call>\n{"name": "take_action", "arguments": {"action": "hit"}}\n</tool_call>'
TRUNCATING = {"top_p": 0.8, "top_k": 7, "min_p": 0.05}


def settings(**policy) -> Settings:
    return Settings(policy=policy)


def turn(seed: int = 3) -> Turn:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Your hand: 12, dealer shows 3."}]
    return Turn(messages, [1, 2, 3], Observation(12, 3, False), False, seed)


def bodies(server: CannedServer) -> list[dict]:
    return [json.loads(b) for b in server.bodies]


# -- the sampling record reaches each policy -----------------------------------------------


def test_the_chat_server_is_sent_every_sampling_setting(gguf_path):
    with CannedServer(chat_answer({"role": "assistant", "content": HIT_CALL})) as server:
        built = make_policy(settings(kind="openai", model="m", base_url=server.url, tokenizer=str(gguf_path),
                                     temperature=0.7, max_tokens=20, **TRUNCATING))
        assert isinstance(built, BuiltPolicy)
        asyncio.run(_respond_and_close(built.policy))
        (body,) = bodies(server)
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["max_tokens"]) == (0.7, 0.8, 7, 0.05, 20)
    assert "response_format" not in body
    params = built.policy.generation_params()
    assert (params["top_k"], params["min_p"]) == (7, 0.05)


def test_the_chat_server_is_not_sent_top_k_or_min_p_unless_set(gguf_path):
    """Hosted APIs refuse unknown fields: the defaults (off) are not sent."""
    with CannedServer(chat_answer({"role": "assistant", "content": HIT_CALL})) as server:
        built = make_policy(settings(kind="openai", model="m", base_url=server.url, tokenizer=str(gguf_path)))
        asyncio.run(_respond_and_close(built.policy))
        (body,) = bodies(server)
    assert "top_k" not in body and "min_p" not in body and body["top_p"] == 1.0


def test_constrained_chat_server_gets_the_structured_output_fields(gguf_path):
    with CannedServer(chat_answer({"role": "assistant", "content": HIT_CALL})) as server:
        built = make_policy(settings(kind="openai", model="m", base_url=server.url, tokenizer=str(gguf_path),
                                     constrained=True, structured_output="guided_json"))
        asyncio.run(_respond_and_close(built.policy))
        (body,) = bodies(server)
    assert body["guided_json"] == CALL_SCHEMA


def _vllm_answer(eos: int) -> dict:
    return {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "stop_reason": None,
                         "logprobs": {"tokens": ["token_id:5", f"token_id:{eos}"], "token_logprobs": [-0.5, -0.1]}}]}


def _sglang_answer(eos: int) -> dict:
    return {"meta_info": {"output_token_logprobs": [[-0.5, 5, "x"], [-0.1, eos, ""]],
                          "finish_reason": {"type": "stop", "matched": eos}}}


def _llamacpp_answer(eos: int) -> dict:
    return {"tokens": [5, eos], "completion_probabilities": [{"id": 5, "logprob": -0.5}, {"id": eos, "logprob": -0.1}],
            "stop_type": "eos"}


@pytest.mark.parametrize("api, answer", [("vllm", _vllm_answer), ("sglang", _sglang_answer), ("llamacpp", _llamacpp_answer)])
def test_pooled_servers_are_sent_every_sampling_setting_and_the_constraint(api, answer, gguf_path, vocab_chat):
    eos = vocab_chat.end_of_turn_ids[0]
    with CannedServer(answer(eos)) as server:
        built = make_policy(settings(kind="openai", model="m", servers=[server.url], server_api=api,
                                     token_path="completions", tokenizer=str(gguf_path), temperature=0.6,
                                     constrained=True, **TRUNCATING))
        asyncio.run(_respond_and_close(built.policy))
        (body,) = bodies(server)
    params = body["sampling_params"] if api == "sglang" else body
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"]) == (0.6, 0.8, 7, 0.05)
    if api == "vllm":
        assert body["response_format"]["json_schema"]["schema"] == CALL_SCHEMA
    elif api == "sglang":
        assert json.loads(params["json_schema"]) == CALL_SCHEMA
    else:
        assert body["json_schema"] == CALL_SCHEMA
    assert built.policy.generation_params()["constrained"] is True


def test_pooled_chat_path_is_sent_top_p_top_k_min_p_and_the_constraint(gguf_path):
    with CannedServer(chat_answer({"role": "assistant", "content": HIT_CALL})) as server:
        built = make_policy(settings(kind="openai", model="m", servers=[server.url], token_path="chat",
                                     tokenizer=str(gguf_path), constrained=True, structured_output="json_object",
                                     **TRUNCATING))
        asyncio.run(_respond_and_close(built.policy))
        (body,) = bodies(server)
    assert (body["top_p"], body["top_k"], body["min_p"]) == (0.8, 7, 0.05)
    assert body["response_format"] == {"type": "json_object", "schema": CALL_SCHEMA}


async def _respond_and_close(policy) -> Reply:
    try:
        return await policy.respond(turn())
    finally:
        await policy.aclose()


@pytest.mark.embedded
def test_the_embedded_model_samples_with_the_cut_it_is_given():
    """top_k 1 at temperature 1 leaves only the most likely token: every seed gives the greedy
    answer, which free sampling at temperature 1 does not."""
    from blackjack_rl.rollout.episodes import opening_messages

    def answers(**policy) -> set[tuple[int, ...]]:
        built = make_policy(settings(kind="embedded", max_tokens=12, n_threads=1, **policy))
        try:
            ids = built.chat.prompt_ids(opening_messages(Observation(13, 10, False), False))
            return {tuple(built.policy.generate(list(ids), seed).completion_ids) for seed in range(6)}
        finally:
            asyncio.run(built.policy.aclose())

    greedy = answers(temperature=0.0)
    assert len(greedy) == 1
    assert answers(temperature=1.0, top_k=1) == greedy
    assert answers(temperature=1.0) != greedy
    nucleus = make_policy(settings(kind="embedded", top_p=0.5, n_threads=1)).policy
    assert nucleus.generation_params()["top_p"] == 0.5
    asyncio.run(nucleus.aclose())


def test_bots_are_tokenized_like_the_embedded_model_and_take_no_sampling():
    built = make_policy(settings(kind="threshold", threshold=15))
    assert built.policy.name == "threshold-15"
    assert built.chat.end_of_turn_ids  # the embedded GGUF's chat format


# -- the torch sampler's distribution on a fixed logits row ------------------------------------


def _frequencies(draws: int = 20000, **cut) -> list[float]:
    torch = pytest.importorskip("torch")
    from blackjack_rl.policies.torch.sampler import draw

    logits = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]]))
    u = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, logp = draw(logits.expand(draws, -1), u, 1.0, **cut)
    counts = torch.bincount(tok[:, 0], minlength=6).double() / draws
    # the reported logprobs are the uncut distribution's, whatever the cut
    assert torch.allclose(logp[0].exp(), torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]), atol=1e-6)
    return counts.tolist()


def _close(freqs: list[float], expected: list[float]) -> bool:
    # 20000 draws: a standard error below 0.0035 per cell; 0.015 is more than four of them
    return all(abs(f - e) < 0.015 for f, e in zip(freqs, expected))


def test_torch_sampler_uncut_draws_the_model_distribution():
    assert _close(_frequencies(), [0.40, 0.25, 0.15, 0.10, 0.06, 0.04])


def test_torch_sampler_top_k_keeps_the_k_most_likely():
    assert _close(_frequencies(top_k=2), [0.40 / 0.65, 0.25 / 0.65, 0, 0, 0, 0])


def test_torch_sampler_top_p_keeps_the_smallest_set_reaching_p():
    # 0.40 + 0.25 = 0.65 < 0.7, so the third token is needed and the fourth is not
    assert _close(_frequencies(top_p=0.7), [0.40 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0])


def test_torch_sampler_min_p_drops_tokens_below_a_share_of_the_best():
    # 0.3 * 0.40 = 0.12: the tokens of 0.10 and less go
    assert _close(_frequencies(min_p=0.3), [0.40 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0])


def test_torch_sampler_cuts_compose():
    assert _close(_frequencies(top_k=3, top_p=0.5), [0.40 / 0.65, 0.25 / 0.65, 0, 0, 0, 0])


# -- settings a policy cannot honour: one line, non-zero, from the CLI ---------------------


@pytest.mark.parametrize("kind, extra, names", [
    ("optimal", {"temperature": 0.5}, ("--policy optimal", "--temperature")),
    ("random", {"top_k": 5}, ("--policy random", "--top-k")),
    ("threshold", {"constrained": True}, ("--policy threshold", "--constrained")),
    ("hf", {"constrained": True}, ("--policy hf", "--constrained")),
    ("embedded", {"constrained": True, "min_p": 0.1}, ("--constrained", "--min-p")),
    ("embedded", {"native_tools": True}, ("--native-tools", "--policy embedded")),
    ("optimal", {"lora": "adapter.gguf"}, ("--lora",)),
    ("embedded", {"max_concurrency_per_server": 8}, ("--server-concurrency", "--policy embedded")),
    # a server pool's options, on the single-server chat client
    ("openai", {"model": "m", "max_concurrency_per_server": 8}, ("--server-concurrency", "--base-url")),
    ("openai", {"model": "m", "sticky": False}, ("--no-sticky", "--base-url")),
    ("openai", {"model": "m", "server_api": "sglang"}, ("--server-api", "--base-url")),
    # a setting only other policies read
    ("random", {"timeout": 5.0}, ("--timeout", "--policy random")),
    ("embedded", {"model": "foo"}, ("--model", "--policy embedded")),
    ("optimal", {"n_threads": 1}, ("--threads", "--policy optimal")),
    ("openai", {"model": "m", "n_ctx": 512}, ("--n-ctx", "--policy openai")),
    ("hf", {"base_url": "http://127.0.0.1:9/v1"}, ("--base-url", "--policy hf")),
    ("optimal", {"threshold": 15}, ("--threshold", "--policy optimal")),
    ("embedded", {"structured_output": "json_object"}, ("--structured-output", "--policy embedded")),
    ("openai", {"model": "m", "structured_output": "json_object"}, ("--structured-output", "--constrained")),
])
def test_check_supported_refuses_what_a_policy_would_ignore(kind, extra, names):
    with pytest.raises(ValueError) as info:
        check_supported(Settings(policy={"kind": kind, **extra}).policy)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


def test_check_supported_accepts_what_each_policy_honours():
    for policy in ({"kind": "embedded", **TRUNCATING, "temperature": 0.3}, {"kind": "embedded", "constrained": True},
                   {"kind": "hf", **TRUNCATING}, {"kind": "optimal", "max_tokens": 32},
                   {"kind": "openai", "model": "m", "constrained": True, **TRUNCATING},
                   {"kind": "openai", "model": "m", "servers": ["http://127.0.0.1:9/v1"], "constrained": True,
                    **TRUNCATING},
                   {"kind": "openai", "model": "m", "servers": ["http://127.0.0.1:9/v1"],
                    "max_concurrency_per_server": 8, "sticky": False, "server_api": "sglang"},
                   {"kind": "openai", "model": "m", "token_path": "completions", "max_concurrency_per_server": 8},
                   {"kind": "openai", "model": "m", "timeout": 5.0, "retries": 0, "constrained": True,
                    "structured_output": "json_object", "api_key": "k"},
                   {"kind": "embedded", "n_threads": 1, "n_ctx": 512, "model_path": "x.gguf", "api_key": "k"},
                   {"kind": "hf", "n_threads": 1, "model_path": "x"},
                   {"kind": "threshold", "threshold": 15, "tokenizer": "x.gguf", "model_path": "x.gguf"}):
        check_supported(Settings(policy=policy).policy)


@pytest.mark.parametrize("flags, names", [
    (["--policy", "optimal", "--temperature", "0.5"], ("--policy optimal", "--temperature")),
    (["--policy", "random", "--top-p", "0.9"], ("--policy random", "--top-p")),
    (["--policy", "hf", "--constrained"], ("--policy hf", "--constrained")),
    (["--policy", "embedded", "--constrained", "--top-p", "0.9"], ("--constrained", "--top-p")),
    (["--policy", "embedded", "--token-path", "chat"], ("--token-path", "--policy embedded")),
    (["--policy", "openai", "--model", "m", "--server-concurrency", "8", "--tokenizer", "GGUF"],
     ("--server-concurrency", "--base-url")),
    (["--policy", "random", "--timeout", "5"], ("--timeout", "--policy random")),
    (["--threads", "4096"], ("--threads 4096", "cores")),  # llama.cpp would crawl: threads spin on 2 cores
    (["--policy", "hf", "--threads", "4096"], ("--threads 4096", "cores")),
    (["--policy", "openai", "--model", "m", "--server", "http://127.0.0.1:9/v1", "--token-path", "completions",
      "--constrained", "--structured-output", "tool_choice", "--tokenizer", "GGUF"], ("tool_choice",)),
])
def test_an_unsupported_combination_is_a_one_line_cli_error(flags, names, tmp_path, gguf_path):
    flags = [str(gguf_path) if f == "GGUF" else f for f in flags]
    run = subprocess.run(
        [*CLI, "evaluate", "--episodes", "2", "--out", str(tmp_path / "out"), "--quiet", *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "out" / "metrics.json").exists()


# -- the retry loop -------------------------------------------------------------------------


def test_retry_counts_attempts_and_reports_the_last_problem():
    calls = []

    def attempt(n: int) -> str:
        calls.append(n)
        raise Retryable(f"down ({n})")

    with pytest.raises(RetriesExhausted) as info:
        retry_sync(RetryPolicy(attempts=4, base_delay_s=0.0, max_elapsed_s=None), attempt)
    assert calls == [1, 2, 3, 4]
    assert info.value.attempts == 4 and info.value.problem == "down (4)"
    assert "failed after 4 attempts; last problem: down (4)" in str(info.value)


def test_retry_returns_the_first_success_and_stops_at_once_on_other_errors():
    calls = []

    async def flaky(n: int) -> int:
        calls.append(n)
        if n < 3:
            raise Retryable("busy")
        return n

    assert asyncio.run(retry_async(RetryPolicy(attempts=5, base_delay_s=0.0), flaky)) == 3
    refused = []

    async def refusal(n: int) -> None:
        refused.append(n)
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        asyncio.run(retry_async(RetryPolicy(attempts=5, base_delay_s=0.0), refusal))
    assert calls == [1, 2, 3] and refused == [1]


def test_retry_after_is_a_lower_bound_on_the_wait():
    calls = []

    def attempt(n: int) -> str:
        calls.append(time.monotonic())
        if n == 1:
            raise Retryable("429", retry_after=0.3)
        return "ok"

    # the backoff alone would wait about a millisecond
    assert retry_sync(RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.001), attempt) == "ok"
    assert calls[1] - calls[0] >= 0.3


def test_retry_stops_rather_than_wait_past_the_time_budget():
    calls = []

    def attempt(n: int) -> str:
        calls.append(n)
        raise Retryable("503", retry_after=60.0)

    started = time.monotonic()
    with pytest.raises(RetriesExhausted) as info:
        retry_sync(RetryPolicy(attempts=10, max_elapsed_s=1.0), attempt)
    assert calls == [1] and info.value.attempts == 1
    assert time.monotonic() - started < 60.0  # it did not sit out the hint


def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=4.0)
    for attempt, nominal in ((1, 1.0), (2, 2.0), (3, 4.0), (6, 4.0)):
        waits = [policy.backoff(attempt) for _ in range(200)]
        assert all(0.5 * nominal <= w < 1.5 * nominal for w in waits)


def test_retry_after_header_parsing():
    assert retry_after_seconds("2") == 2.0 and retry_after_seconds("0.5") == 0.5
    assert retry_after_seconds("-3") == 0.0
    assert retry_after_seconds(None) is None and retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_seconds("nan") is None and retry_after_seconds("inf") is None


def test_a_retry_policy_needs_an_attempt():
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


# -- n answers at once, else one by one ------------------------------------------------------


class _Many:
    name = "many"

    def __init__(self, answer) -> None:
        self.answer, self.calls = answer, 0

    def generation_params(self) -> dict:
        return {}

    async def respond(self, turn: Turn) -> Reply:
        return Reply(text="one")

    async def respond_many(self, turn: Turn, n: int) -> list[Reply]:
        self.calls += 1
        return self.answer(n)

    async def aclose(self) -> None:
        pass


def _fails(n: int) -> list[Reply]:
    raise InferenceError("server down")


@pytest.mark.parametrize("answer, expected", [
    (lambda n: [Reply(text=str(i)) for i in range(n)], ["0", "1", "2"]),
    (lambda n: [Reply(text="short")], None),  # fewer than asked: the caller asks one by one
    (_fails, None),
])
def test_answers_at_once(answer, expected):
    policy = _Many(answer)
    replies = asyncio.run(answers_at_once(policy, turn(), 3))
    assert policy.calls == 1
    assert (None if replies is None else [r.text for r in replies]) == expected


def test_answers_at_once_is_not_asked_for_one_answer_or_of_a_policy_without_it():
    policy = _Many(lambda n: [Reply(text="x")] * n)
    assert asyncio.run(answers_at_once(policy, turn(), 1)) is None and policy.calls == 0

    class One:
        async def respond(self, turn: Turn) -> Reply:
            return Reply(text="one")

    assert asyncio.run(answers_at_once(One(), turn(), 4)) is None


def test_a_bug_in_respond_many_is_not_hidden():
    def broken(n: int) -> list[Reply]:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        asyncio.run(answers_at_once(_Many(broken), turn(), 2))


def test_sampling_truncates_only_when_a_cut_is_set():
    assert not Sampling().truncates
    assert all(Sampling(**{k: v}).truncates for k, v in TRUNCATING.items())
