"""Trajectories are built by extension; they must equal a full render of the conversation."""

import asyncio

import pytest

from blackjack_rl.rollout.episodes import EpisodeSettings, play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.policies.bots import OptimalBot, ThresholdBot
from blackjack_rl.contract.tokens import MASKED, MASKED_LOGPROB, ChatFormat, HFTokenizer, trained_spans


def _play(policy, chat, solution, seed):
    return asyncio.run(play_episode(Table(Rules()), policy, chat, solution, seed, 0, EpisodeSettings()))


def _multi_turn_seeds(policy, chat, solution, want=5):
    eps = []
    for seed in range(200):
        ep = _play(policy, chat, solution, seed)
        if len(ep.decisions) >= 2:
            eps.append(ep)
        if len(eps) == want:
            return eps
    raise AssertionError("no multi-turn episodes found")


def test_extension_equals_a_full_render(vocab_chat, solution):
    """Turn-by-turn ids == tokenizing the whole rendered conversation (the slow, obvious way)."""
    for ep in _multi_turn_seeds(ThresholdBot(19), vocab_chat, solution):
        full = vocab_chat.backend.encode(vocab_chat.backend.render(ep.messages, add_generation_prompt=False))
        assert ep.trajectory.tokens == full[: len(ep.trajectory.tokens)]
        # what remains is only the template's newline after the last end-of-turn
        assert vocab_chat.backend.decode(full[len(ep.trajectory.tokens):]) == "\n"


def test_trained_positions_decode_to_exactly_the_assistant_turns(vocab_chat, solution):
    for ep in _multi_turn_seeds(OptimalBot(solution), vocab_chat, solution):
        spans = trained_spans(ep.trajectory.masks)
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert len(spans) == len(answers)
        for (a, b), answer in zip(spans, answers):
            assert vocab_chat.backend.decode(ep.trajectory.tokens[a:b]) == answer + "<|im_end|>"
            assert ep.trajectory.masks[a:b] == ep.trajectory.tokens[a:b]
        assert all(lp == MASKED_LOGPROB for lp, m in zip(ep.trajectory.logprobs, ep.trajectory.masks) if m == MASKED)


def test_hf_tokenizer_gives_the_same_ids_as_llama_cpp(hf_tokenizer_dir, gguf_path, vocab_chat, solution):
    """The server path (transformers) and the embedded path agree token for token."""
    hf_chat = ChatFormat.learn(HFTokenizer(str(hf_tokenizer_dir)))
    assert hf_chat.backend.eos_token == "<|im_end|>"
    assert (hf_chat.glue, hf_chat.tail, hf_chat.end_of_turn_ids) == (
        vocab_chat.glue, vocab_chat.tail, vocab_chat.end_of_turn_ids)
    for ep in _multi_turn_seeds(ThresholdBot(19), vocab_chat, solution, want=3):
        hf_ep = _play(ThresholdBot(19), hf_chat, solution, ep.seed)
        assert hf_ep.trajectory.tokens == ep.trajectory.tokens
    for text in ["Hello 12345 world!!  \n\t ünïcödé 🂡", "<tool_call>{'a': 1}</tool_call>", " leading space"]:
        assert hf_chat.backend.encode(text) == vocab_chat.backend.encode(text)


def test_a_template_that_rewrites_history_is_refused():
    class Rewriting:
        name = "rewriting"
        eos_token = "</s>"

        def render(self, messages, add_generation_prompt):
            # e.g. a template that drops earlier turns: not extendable turn by turn
            return "".join(f"[{m['role']}]{m['content']}" for m in messages[-2:]) + ("[a]" if add_generation_prompt else "")

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    with pytest.raises(ValueError, match="does not extend turn by turn"):
        ChatFormat.learn(Rewriting())
