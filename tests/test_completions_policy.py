"""Token-exact rollouts: the trained ids are exactly the ids the server returned.

Against a mock of vLLM's completions API (tests/mock_openai_server.py) and against the
real llama-cpp-python server, which cannot return token ids and must fall back to chat.
"""

from __future__ import annotations

import asyncio

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_completions import CHAT_PATH, COMPLETIONS_PATH, OpenAICompletionsPolicy
from blackjack_rl.policies.pool import ServerPool, ServerSpec
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.contract.tokens import MASKED, ChatFormat, HFTokenizer, trained_spans
from mock_openai_server import MockServer, blackjack_answers, write_config

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mock(tmp_path_factory, vocab_chat):
    cfg = write_config(tmp_path_factory.mktemp("mock") / "answers.json", blackjack_answers(vocab_chat),
                       vocab_chat.end_of_turn_ids[0])
    server = MockServer(cfg)
    yield server
    server.kill()


@pytest.fixture
def fresh(mock):
    mock.control(reset=True)
    return mock


def policy_for(urls, chat, *, model="mock", max_tokens=48, token_path="auto", **pool_args):
    pool_args.setdefault("timeout", 10.0)
    pool = ServerPool([ServerSpec(u) for u in urls], **pool_args)
    return OpenAICompletionsPolicy(pool, model, chat, sampling=Sampling(max_tokens=max_tokens), token_path=token_path)


def play_groups(policy, chat, solution, seeds, group_size):
    async def main():
        player = Player(policy, chat, solution)
        try:
            return [await play_group(player, seed, GroupConfig(group_size=group_size)) for seed in seeds]
        finally:
            await policy.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def returned_by_prompt(stats):
    out: dict[tuple[int, ...], list[dict]] = {}
    for entry in stats["log"]:
        out.setdefault(tuple(entry["prompt"]), []).extend(entry["choices"])
    return out


def test_trained_ids_and_logprobs_are_exactly_what_the_server_returned(fresh, vocab_chat, solution):
    policy = policy_for([fresh.url], vocab_chat)
    results = play_groups(policy, vocab_chat, solution, range(6), 8)
    stats = fresh.stats()
    returned = returned_by_prompt(stats)
    spans_checked = 0
    for result in results:
        assert result.group is not None, [ep.error for ep in result.episodes]
        g = result.group
        assert g.generation_params["token_path"] == COMPLETIONS_PATH
        for tokens, masks, logprobs in zip(g.tokens, g.masks, g.inference_logprobs):
            spans = trained_spans(masks)
            assert spans
            for a, b in spans:
                candidates = returned[tuple(tokens[:a])]  # the prompt the server was sent
                matches = [c for c in candidates if c["ids"] == tokens[a:b]]
                assert matches, "trained ids differ from every completion the server returned for that prompt"
                assert any(c["logprobs"] == logprobs[a:b] for c in matches)
                assert masks[a:b] == tokens[a:b]
                spans_checked += 1
    assert spans_checked >= 48
    # one request with n = group size per group (the shared first turn), plus the probe
    n_requests = [len(e["choices"]) for e in stats["log"]]
    assert n_requests.count(8) == 6


def test_a_truncated_answer_is_trained_as_sampled_and_closed_as_context(fresh, vocab_chat, solution):
    """max_tokens cuts every answer: the ids stay as returned, the end-of-turn id is context."""
    eot = vocab_chat.end_of_turn_ids[0]
    policy = policy_for([fresh.url], vocab_chat, max_tokens=6)
    results = play_groups(policy, vocab_chat, solution, [7], 4)
    returned = returned_by_prompt(fresh.stats())
    for ep in results[0].episodes:
        (a, b), = trained_spans(ep.trajectory.masks)
        assert any(c["ids"] == ep.trajectory.tokens[a:b] for c in returned[tuple(ep.trajectory.tokens[:a])])
        assert ep.trajectory.tokens[b] == eot and ep.trajectory.masks[b] == MASKED


def test_end_of_turn_is_added_only_when_the_server_says_it_stopped_on_it(fresh, vocab_chat, solution):
    eot = vocab_chat.end_of_turn_ids[0]
    fresh.control(omit_eos=True)  # a server that stops on EOS but leaves it out of the tokens
    policy = policy_for([fresh.url], vocab_chat)
    turn = Turn([], vocab_chat.backend.encode("hello"), None, False, 11)

    async def main():
        try:
            return await policy.respond_many(turn, 16)
        finally:
            await policy.aclose()

    replies = asyncio.run(main())
    returned = returned_by_prompt(fresh.stats())[tuple(turn.prompt_ids)]
    for reply, sent in zip(replies, returned):
        if reply.finish_reason == "stop":  # stopped on EOS: appended, with probability one
            assert reply.completion_ids == sent["ids"] + [eot] and reply.logprobs == sent["logprobs"] + [0.0]
        else:  # ran out of tokens: nothing appended
            assert reply.completion_ids == sent["ids"] and eot not in sent["ids"]
    assert {r.finish_reason for r in replies} == {"stop", "length"}


def test_a_server_that_ignores_n_is_topped_up_with_the_same_samples(fresh, vocab_chat):
    turn = Turn([], vocab_chat.backend.encode("deal"), None, False, 1234)

    def sample(ignore_n):
        fresh.control(reset=True, ignore_n=ignore_n)
        policy = policy_for([fresh.url], vocab_chat, token_path="completions")

        async def main():
            try:
                return await policy.respond_many(turn, 8)
            finally:
                await policy.aclose()

        replies = asyncio.run(main())
        return [r.completion_ids for r in replies], fresh.stats()["requests"]["/v1/completions"]

    honoured, one_request = sample(False)
    topped_up, eight_requests = sample(True)
    assert (one_request, eight_requests) == (1, 8)
    assert honoured == topped_up  # choice i of a seeded n-request == a single request seeded seed + i


def test_an_answer_without_token_ids_fails_the_request_without_retrying(fresh, vocab_chat, solution):
    fresh.control(bad_shape=True)
    policy = policy_for([fresh.url], vocab_chat, token_path="completions", retries=3)

    async def main():
        try:
            with pytest.raises(InferenceError, match="without usable token ids"):
                await policy.respond(Turn([], [1, 2, 3], None, False, 0))
        finally:
            await policy.aclose()

    asyncio.run(main())
    assert fresh.stats()["requests"]["/v1/completions"] == 1


def test_a_wrong_model_name_is_a_clear_error_not_retried(fresh, vocab_chat):
    policy = policy_for([fresh.url], vocab_chat, model="no-such-model", token_path="completions", retries=3)

    async def main():
        try:
            with pytest.raises(InferenceError, match="HTTP 404.*not retried"):
                await policy.respond(Turn([], [1, 2, 3], None, False, 0))
        finally:
            await policy.aclose()

    asyncio.run(main())
    assert fresh.stats()["requests"]["/v1/completions"] == 1


# -- the documented answer shapes of SGLang and llama.cpp's server -----------------------


def _replies(api, data, chat):
    policy = OpenAICompletionsPolicy(ServerPool([ServerSpec("http://127.0.0.1:9/v1")]), "m", chat, api=api)
    return [policy._reply(s) for s in policy.api.samples(data)]


def test_sglang_generate_answers(vocab_chat):
    eot = vocab_chat.end_of_turn_ids[0]
    one = {"text": "hi", "output_ids": [5, 6, eot], "meta_info": {
        "finish_reason": {"type": "stop", "matched": eot},
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None], [-0.125, eot, None]]}}
    (r,) = _replies("sglang", one, vocab_chat)
    assert (r.completion_ids, r.logprobs, r.finish_reason) == ([5, 6, eot], [-0.5, -0.25, -0.125], "stop")
    # n = 2: a list; one stopped on the end-of-turn token without returning it, one cut by max_new_tokens
    two = [
        {"text": "a", "meta_info": {"finish_reason": {"type": "stop", "matched": eot},
                                    "output_token_logprobs": [[-0.5, 7, "a"]]}},
        {"text": "b", "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                    "output_token_logprobs": [[-0.75, 8, "b"]]}},
    ]
    a, b = _replies("sglang", two, vocab_chat)
    assert (a.completion_ids, a.logprobs, a.finish_reason) == ([7, eot], [-0.5, 0.0], "stop")
    assert (b.completion_ids, b.logprobs, b.finish_reason) == ([8], [-0.75], "length")
    with pytest.raises(ValueError, match="output_token_logprobs"):
        _replies("sglang", {"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}}, vocab_chat)


def test_llama_cpp_server_completion_answers(vocab_chat):
    eot = vocab_chat.end_of_turn_ids[0]
    probs = [{"id": 5, "logprob": -0.5, "token": "x", "top_logprobs": []},
             {"id": eot, "logprob": -0.25, "token": "", "top_logprobs": []}]
    # the EOS scored in completion_probabilities but left out of `tokens`: taken with its logprob
    (r,) = _replies("llamacpp", {"content": "x", "tokens": [5], "stop_type": "eos",
                                 "completion_probabilities": probs}, vocab_chat)
    assert (r.completion_ids, r.logprobs, r.finish_reason) == ([5, eot], [-0.5, -0.25], "stop")
    (r,) = _replies("llamacpp", {"content": "x", "tokens": [5], "stop_type": "limit",
                                 "completion_probabilities": probs[:1]}, vocab_chat)
    assert (r.completion_ids, r.logprobs, r.finish_reason) == ([5], [-0.5], "length")
    with pytest.raises(ValueError, match="disagree"):
        _replies("llamacpp", {"tokens": [6], "stop_type": "limit", "completion_probabilities": probs[:1]}, vocab_chat)


def test_request_bodies_state_a_neutral_sampler(vocab_chat):
    """Servers apply their own defaults (vLLM the model's generation_config, llama-server
    top_k 40 / min_p 0.05) unless told otherwise; the trainer must know the distribution."""
    from blackjack_rl.policies.openai_completions import APIS

    vllm = APIS["vllm"].body("m", [1, 2], 16, 7, Sampling())
    assert vllm["prompt"] == [1, 2] and vllm["n"] == 16 and vllm["seed"] == 7
    assert vllm["logprobs"] == 0 and vllm["return_tokens_as_token_ids"] is True
    assert (vllm["top_k"], vllm["min_p"], vllm["repetition_penalty"]) == (-1, 0.0, 1.0)
    sglang = APIS["sglang"].body("m", [1, 2], 4, 7, Sampling())
    assert sglang["input_ids"] == [1, 2] and sglang["return_logprob"] is True and sglang["sampling_params"]["n"] == 4
    llama = APIS["llamacpp"].body("m", [1, 2], 1, 7, Sampling())
    assert llama["prompt"] == [1, 2] and llama["return_tokens"] is True and llama["n_probs"] == 1
    assert (llama["top_k"], llama["min_p"], llama["repeat_penalty"]) == (0, 0.0, 1.0)


# -- the real llama-cpp-python server: no token ids, so the chat path --------------------


@pytest.mark.embedded
@pytest.mark.parametrize("api", ["vllm", "sglang", "llamacpp"])
def test_llama_cpp_python_cannot_return_token_ids_so_chat_is_used(llama_server, hf_tokenizer_dir, api):
    chat = ChatFormat.learn(HFTokenizer(str(hf_tokenizer_dir)))
    pool = ServerPool([ServerSpec(llama_server)], timeout=60)
    policy = OpenAICompletionsPolicy(pool, "smollm2", chat, api=api, sampling=Sampling(max_tokens=24))

    async def main():
        try:
            return await policy.respond(Turn([{"role": "user", "content": "Say hi."}], [], None, False, 3))
        finally:
            await policy.aclose()

    reply = asyncio.run(main())
    assert policy.token_path == CHAT_PATH
    assert llama_server in policy.generation_params()["token_path_reason"]
    assert reply.completion_ids is None and reply.text


@pytest.mark.embedded
def test_groups_through_llama_cpp_python_record_the_chat_path(llama_server, hf_tokenizer_dir, solution):
    chat = ChatFormat.learn(HFTokenizer(str(hf_tokenizer_dir)))
    pool = ServerPool([ServerSpec(llama_server)], timeout=60, max_concurrency=1)
    policy = OpenAICompletionsPolicy(pool, "smollm2", chat, sampling=Sampling(max_tokens=24))
    (result,) = play_groups(policy, chat, solution, [5], 3)  # the server ignores n: topped up
    assert not any(ep.failed for ep in result.episodes), [ep.error for ep in result.episodes]
    assert result.group.generation_params["token_path"] == CHAT_PATH
    for ep in result.episodes:
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        spans = trained_spans(ep.trajectory.masks)
        for (a, b), answer in zip(spans, answers):
            assert chat.backend.decode(ep.trajectory.tokens[a:b]) == answer + "<|im_end|>"


# -- configuration ----------------------------------------------------------------------


def test_servers_come_from_repeated_flags_or_yaml(tmp_path, gguf_path):
    from blackjack_rl.cli import build_parser, settings_from_args
    from blackjack_rl.config import load_settings
    from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
    from blackjack_rl.rollout.players import build_player

    base = ["evaluate", "--policy", "openai", "--model", "m", "--tokenizer", str(gguf_path)]
    args = build_parser().parse_args(base + ["--server", "http://127.0.0.1:9/v1,3", "--server", "http://127.0.0.1:8/v1",
                                             "--server-api", "sglang", "--server-concurrency", "7"])
    policy = build_player(settings_from_args(args)).policy
    assert isinstance(policy, OpenAICompletionsPolicy) and policy.api.name == "sglang"
    assert [(s["url"], s["weight"], s["cap"]) for s in policy.pool.snapshot()] == [
        ("http://127.0.0.1:9/v1", 3.0, 7), ("http://127.0.0.1:8/v1", 1.0, 7)]

    yaml = tmp_path / "settings.yaml"
    yaml.write_text(
        "policy:\n  kind: openai\n  model: m\n  token_path: chat\n"
        f"  tokenizer: {gguf_path}\n"
        "  servers: ['http://127.0.0.1:9/v1,2', {url: 'http://127.0.0.1:8/v1', max_concurrency: 4}]\n"
    )
    policy = build_player(load_settings(yaml)).policy
    assert policy.token_path == CHAT_PATH
    assert [(s["url"], s["weight"], s["cap"]) for s in policy.pool.snapshot()] == [
        ("http://127.0.0.1:9/v1", 2.0, 128), ("http://127.0.0.1:8/v1", 1.0, 4)]

    # no servers and no token path: the single-server chat client, as before
    assert isinstance(build_player(settings_from_args(build_parser().parse_args(base))).policy, OpenAIChatPolicy)

    with pytest.raises(ValueError, match="URL,WEIGHT"):
        settings_from_args(build_parser().parse_args(base + ["--server", "http://127.0.0.1:9/v1,heavy"]))


# -- answers of odd shapes on the token-id path: a failed episode with a reason, never a crash --

def _vllm(tokens, logprobs, **choice):
    return {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": tokens, "token_logprobs": logprobs},
                         "finish_reason": "stop", "stop_reason": None, **choice}]}


def _sglang(triples, finish={"type": "stop", "matched": None}):
    return {"text": "", "meta_info": {"finish_reason": finish, "output_token_logprobs": triples}}


ODD_TOKEN_ANSWERS = {
    "vllm": {
        "logprobs nested": _vllm(["token_id:5"], [[-0.1]]),
        "logprobs as strings": _vllm(["token_id:5"], ["-0.1"]),
        "logprobs null": _vllm(["token_id:5"], [None]),
        "logprobs positive": _vllm(["token_id:5"], [3.0]),
        "logprobs shorter than tokens": _vllm(["token_id:5", "token_id:6"], [-0.1]),
        "logprobs is a list": {"choices": [{"index": 0, "logprobs": [], "finish_reason": "stop"}]},
        "tokens is a string": _vllm("token_id:5", [-0.1]),
        "tokens are numbers": _vllm([5], [-0.1]),
        "token_ids is a number": _vllm(["token_id:5"], [-0.1], token_ids=5),
        "finish_reason is a number": _vllm(["token_id:5"], [-0.1], finish_reason=5),
        "index of mixed types": {"choices": [_vllm(["token_id:5"], [-0.1], index="1")["choices"][0],
                                             _vllm(["token_id:5"], [-0.1], index=0)["choices"][0]]},
        "choices is a dict": {"choices": {"0": {}}},
        "no choices": {"id": "x"},
        "the answer is a list": [1, 2],
    },
    "sglang": {
        "short triples": _sglang([[-0.1]]),
        "id is a string": _sglang([[-0.1, "5", None]]),
        "logprob is a list": _sglang([[[-0.1], 5, None]]),
        "finish_reason is a list": _sglang([[-0.1, 5, None]], finish=[]),
        "meta_info is a string": {"meta_info": "x"},
    },
    "llamacpp": {
        "id is a string": {"tokens": [5], "stop_type": "eos", "completion_probabilities": [{"id": "5", "logprob": -0.1}]},
        "tokens is a dict": {"tokens": {"a": 5}, "stop_type": "eos", "completion_probabilities": [{"id": 5, "logprob": -0.1}]},
        "tokens is a number": {"tokens": 5, "stop_type": "eos", "completion_probabilities": [{"id": 5, "logprob": -0.1}]},
        "no stop_type": {"tokens": [5], "completion_probabilities": [{"id": 5, "logprob": -0.1}]},
        "probabilities are numbers": {"tokens": [5], "stop_type": "eos", "completion_probabilities": [5]},
        "the answer is a list": [],
    },
}


@pytest.mark.parametrize("api,name", [(api, name) for api, cases in ODD_TOKEN_ANSWERS.items() for name in cases])
def test_a_token_answer_of_the_wrong_shape_fails_the_episode_with_a_reason(api, name, vocab_chat, solution, caplog):
    from blackjack_rl.rollout.episodes import play_episode
    from blackjack_rl.game.table import Rules, Table
    from canned_server import CannedServer

    with CannedServer(ODD_TOKEN_ANSWERS[api][name]) as server:
        pool = ServerPool([ServerSpec(server.url)], retries=0, timeout=10)
        policy = OpenAICompletionsPolicy(pool, "m", vocab_chat, api=api, token_path="completions")

        async def main():
            try:
                return await play_episode(Table(Rules()), policy, vocab_chat, solution, 1)
            finally:
                await policy.aclose()

        ep = asyncio.run(asyncio.wait_for(main(), 60))
    assert ep.failed and ep.score is None and ep.outcome is None
    assert f"{api} server answered" in ep.error
    assert not [r for r in caplog.records if r.exc_info]  # a reason, not a logged traceback


@pytest.mark.parametrize("api,answer,reason", [
    ("vllm", _vllm(["token_id:49999999"], [-0.1]), "outside the tokenizer's 49152 ids"),
    ("vllm", _vllm(["token_id:-5"], [-0.1]), "is not of the form 'token_id:N'"),
    ("sglang", _sglang([[-0.1, 10**9, None]]), "outside the tokenizer's 49152 ids"),
    ("sglang", _sglang([[-0.1, -5, None]]), "not a non-negative integer"),
    ("llamacpp", {"tokens": [2**31 - 1], "stop_type": "eos",
                  "completion_probabilities": [{"id": 2**31 - 1, "logprob": -0.1}]}, "outside the tokenizer's 49152 ids"),
    ("llamacpp", {"tokens": [-1], "stop_type": "eos", "completion_probabilities": [{"id": -1, "logprob": -0.1}]},
     "not a non-negative integer"),
], ids=["vllm-large", "vllm-negative", "sglang-large", "sglang-negative", "llamacpp-large", "llamacpp-negative"])
def test_an_id_outside_the_vocabulary_fails_the_episode_instead_of_aborting_the_process(api, answer, reason, tmp_path,
                                                                                      gguf_path):
    """Decoding such an id aborts the process inside llama.cpp (std::out_of_range), so the whole
    command runs as a subprocess: it must end normally with the episodes reported failed."""
    import json
    import subprocess

    from canned_server import CannedServer
    from helpers import CLI

    with CannedServer(answer) as server:
        proc = subprocess.run(
            [*CLI, "evaluate", "--policy", "openai", "--server", server.url,
             "--server-api", api, "--token-path", "completions", "--model", "m", "--tokenizer", str(gguf_path),
             "--retries", "0", "--episodes", "2", "--out", str(tmp_path / "run"), "--quiet"],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 3, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["episodes_failed"] == 2 and reason in metrics["failure_examples"][0]
