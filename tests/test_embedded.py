"""The real embedded model (SmolLM2-135M-Instruct via llama.cpp): ids, masks, logprobs, constrained decoding."""

import asyncio

import numpy as np
import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import opening_messages, play_episode
from blackjack_rl.game.solver import HIT, STICK
from blackjack_rl.game.table import Observation, Rules, Table
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.contract.protocol import observation_text, parse_action, tool_call_text
from blackjack_rl.contract.tokens import MASKED, MASKED_LOGPROB, trained_spans

pytestmark = pytest.mark.embedded


def _prompt(policy, obs=Observation(14, 10, False)):
    return policy.chat.prompt_ids(opening_messages(obs))


def test_prompt_is_the_chatml_render(embedded):
    ids = _prompt(embedded)
    text = embedded.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are an AI agent playing Blackjack")
    assert text.endswith("Your current hand sum is 14. The dealer is showing a 10. You have a usable ace: no.<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1  # <|im_start|>, and no BOS added: the GGUF says add_bos_token=False


def test_seeded_sampling_is_reproducible_and_seeds_differ(embedded):
    ids = _prompt(embedded)
    a, b = embedded.generate(ids, seed=42), embedded.generate(ids, seed=42)
    assert a.completion_ids == b.completion_ids and a.text == b.text
    others = {tuple(embedded.generate(ids, seed=s).completion_ids) for s in range(4)}
    assert len(others) > 1


def test_logprobs_are_the_model_log_softmax_of_the_sampled_ids(embedded):
    """Replay the sequence in a fresh context, one token at a time, and recompute each logprob."""
    ids = _prompt(embedded)
    llama = embedded.llama
    llama.reset()  # a cold cache: the replay below then runs the very same kernels
    reply = embedded.generate(ids, seed=7)
    assert len(reply.logprobs) == len(reply.completion_ids) > 0
    assert all(lp <= 0.0 for lp in reply.logprobs)
    llama.reset()
    llama.eval(ids[:-1])
    for tok in [ids[-1]] + reply.completion_ids[:-1]:
        llama.eval([tok])
    logits = np.asarray(llama.scores[len(ids) - 1 : len(ids) - 1 + len(reply.completion_ids)], dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    expected = logits[np.arange(len(reply.completion_ids)), reply.completion_ids] - logz
    np.testing.assert_allclose(reply.logprobs, expected, atol=1e-5)


def test_an_episode_trains_on_exactly_the_sampled_ids(embedded, solution):
    for seed in range(3):
        ep = asyncio.run(play_episode(Table(Rules()), embedded, embedded.chat, solution, seed))
        assert ep.status in ("finished", "invalid", "truncated")
        t = ep.trajectory
        assert len(t.tokens) == len(t.masks) == len(t.logprobs)
        spans = trained_spans(t.masks)
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert len(spans) == len(answers) == len(ep.decisions)
        for (a, b), answer in zip(spans, answers):
            sampled = t.tokens[a:b]
            assert t.masks[a:b] == sampled
            assert all(lp <= 0.0 for lp in t.logprobs[a:b])
            decoded = embedded.tokenizer.decode(sampled)
            # the model's own end-of-turn token is trained when it sampled one
            assert decoded in (answer, answer + "<|im_end|>")
        assert all(lp == MASKED_LOGPROB for lp, m in zip(t.logprobs, t.masks) if m == MASKED)


def test_constrained_decoding_always_gives_a_valid_call(embedded_constrained):
    ids = _prompt(embedded_constrained, Observation(12, 3, False))
    for seed in range(8):
        reply = embedded_constrained.generate(ids, seed=seed)
        parsed = parse_action(reply.text)
        assert parsed.valid, reply.text
        assert reply.finish_reason == "stop"


def test_a_small_group_on_the_embedded_model(embedded, solution):
    player = Player(embedded, embedded.chat, solution)
    result = asyncio.run(play_group(player, 2024, GroupConfig(group_size=3)))
    g = result.group
    assert g is not None
    assert len(g.tokens) == 3 and g.generation_params["policy"] == "embedded"
    prompt_len = min(m.index(next(x for x in m if x != MASKED)) for m in g.masks)
    assert len({tuple(t[:prompt_len]) for t in g.tokens}) == 1
    assert all(len(t) <= 1024 for t in g.tokens)


def _turn(ids, seed):
    from blackjack_rl.policies.base import Turn

    return Turn(messages=[], prompt_ids=ids, observation=None, natural=False, seed=seed)


def test_batched_sampling_gives_the_ids_and_logprobs_of_one_at_a_time(embedded):
    """More prompts than sequences decode together, of different deals and lengths (a later turn
    included): each answer is bit-for-bit the one the single-context path samples for its seed,
    and the decodes did hold several sequences at once."""
    prompts = [_prompt(embedded, Observation(5 + 3 * i % 17, 1 + i % 10, i % 4 == 0)) for i in range(embedded.parallel + 3)]
    prompts[1] = prompts[1] + embedded.tokenizer.encode("<tool_call>") + prompts[2][-5:]
    seeds = [1000 + 7 * i for i in range(len(prompts))]
    alone = [embedded.generate(p, s) for p, s in zip(prompts, seeds)]

    rows: list[int] = []

    async def together():
        return await asyncio.gather(*(embedded.respond(_turn(p, s)) for p, s in zip(prompts, seeds)))

    first = asyncio.run(together())  # makes the batch context
    batcher_decode = embedded._batcher._decode

    def counting(items, every_row=False):
        if every_row:
            rows.append(len(items))
        return batcher_decode(items, every_row)

    embedded._batcher._decode = counting
    try:
        again = asyncio.run(together())  # a warm cache: prefixes reused, streams copied
    finally:
        embedded._batcher._decode = batcher_decode
    for a, b, c in zip(alone, first, again):
        assert b.completion_ids == a.completion_ids and c.completion_ids == a.completion_ids
        assert b.logprobs == a.logprobs and c.logprobs == a.logprobs
        assert b.text == a.text and b.finish_reason == a.finish_reason
    assert max(rows) == embedded.parallel  # every sequence decoded in one step
    assert len(rows) < sum(len(r.completion_ids) for r in alone) / 2


def test_a_prompt_body_is_never_decoded_one_token_alone():
    from blackjack_rl.policies.llama_batch import body_chunks, body_start

    assert body_start(99, 100) == 98 and body_start(100, 100) == 100 and body_start(40, 100) == 40
    assert body_start(0, 1) == 0  # a body of one token can only go alone
    for stop in range(2, 40):
        for start in range(stop - 1):
            chunks = body_chunks(start, stop, 8)
            assert chunks[0][0] == start and chunks[-1][1] == stop
            assert all(b - a >= 2 and b - a <= 8 for a, b in chunks)
            assert all(chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1))


def test_a_later_turn_is_the_same_whatever_the_cache_held(embedded):
    """A later turn's prompt holds the earlier answer, which sampling decoded token by token
    (other kernels than a chunk of tokens). Sampled right after that answer (warm: in the single
    context and in a batched stream) or from an empty cache (cold), the turn gets the same ids and
    logprobs, and scoring the two calls there gives the same logprobs. This is what makes an
    evaluation play the same at any concurrency."""
    first = _prompt(embedded, Observation(13, 10, False))
    answer = embedded.generate(first, 11)
    later = first + answer.completion_ids + embedded.chat.next_turn_ids(observation_text(17, 10, False))
    calls = [embedded.chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]

    def cold():
        embedded.llama.reset()

    def warm():
        assert embedded.generate(first, 11).completion_ids == answer.completion_ids

    replies, scores = {}, {}
    for name, setup in (("cold", cold), ("warm", warm)):
        setup()
        replies[name] = embedded.generate(later, 12)
        setup()
        scores[name] = asyncio.run(embedded.answer_logprobs(later, calls))

    async def batched():
        await embedded.respond(_turn(first, 11))  # the stream that answers next holds this answer
        return await embedded.respond(_turn(later, 12))

    replies["batched"] = asyncio.run(batched())
    for name in ("warm", "batched"):
        assert replies[name].completion_ids == replies["cold"].completion_ids, name
        assert replies[name].logprobs == replies["cold"].logprobs, name
    assert scores["warm"] == scores["cold"]


def test_a_prompt_body_is_decoded_without_logits_and_the_same_bits_follow(embedded):
    """No logit of a prompt's body is read (its last token follows alone), so the body is decoded
    without the vocabulary head. The calls scored after it are the same bits as after a body
    decoded with every position's logits, as llama-cpp-python's `logits_all` decodes it."""
    prompt = _prompt(embedded, Observation(15, 9, False))
    calls = [embedded.chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]
    llama = embedded.llama
    real_eval, asked = llama.eval, []

    def spy(ids):
        asked.append((len(ids), llama._logits_all))
        return real_eval(ids)

    llama.reset()
    llama.eval = spy
    try:
        scored = asyncio.run(embedded.answer_logprobs(prompt, calls))
    finally:
        del llama.eval
    assert asked[0] == (len(prompt) - 1, False)  # the body, one chunk from an empty cache
    assert all(logits for _, logits in asked[1:])  # the last prompt token and the calls: logits read
    llama.reset()
    llama.eval(prompt[:-1])  # the body with every position's logits
    embedded._body = len(prompt) - 1
    assert asyncio.run(embedded.answer_logprobs(prompt, calls)) == scored


def test_batched_sampling_refuses_a_prompt_longer_than_the_context(embedded):
    from blackjack_rl.policies.base import InferenceError

    with pytest.raises(InferenceError, match="exceeds the context"):
        asyncio.run(embedded.respond(_turn([1] * 1024, 0)))


def test_models_load_without_amx_or_repacked_weight_buffers(gguf_path):
    """ggml's AMX matmul segfaults on some AMX machines (llama.cpp #20824): the weights must land in plain
    CPU buffers. llama.cpp reports where each weight buffer went on stderr, read here from a subprocess."""
    import subprocess
    import sys

    code = ("from blackjack_rl.policies.llama_load import load_llama; import llama_cpp, llama_cpp.llama as h; "
            f"load_llama(model_path={str(gguf_path)!r}, n_ctx=256, verbose=True); "
            "assert h.llama_cpp.llama_model_default_params is llama_cpp.llama_cpp.llama_model_default_params; "
            "assert llama_cpp.llama_model_default_params().use_extra_bufts")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    buffers = [line for line in run.stderr.splitlines() if "model buffer size" in line]
    assert buffers and all("CPU_Mapped" in line or " CPU " in line for line in buffers), buffers
