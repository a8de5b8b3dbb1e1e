"""The forced calls' format credit as the likelihood of a call, and leaving near-certain tokens untrained."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from blackjack_rl.config import GroupConfig, TrainConfig
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.train.groups import read_group
from blackjack_rl.contract.tokens import MASKED, MASKED_LOGPROB, trained_spans
from blackjack_rl.rollout.credit import action_char_span, action_token_indices, likelihood_format
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.stepgroups import play_step_groups
from blackjack_rl.train.grpo import merge_groups
from helpers import ScoringStub, run_cli


def test_likelihood_credit_is_the_gradient_of_log_p_of_a_call():
    """Two calls that share a start, then differ at the action word and after it: the credit
    weight * p(a | a call) on each call's tokens gives exactly the gradient of
    weight * log(P(hit call) + P(stick call)), whatever the logits."""
    torch.manual_seed(0)
    vocab, shared, tail, weight = 7, 3, 4, 0.7
    calls = {HIT: [1, 2, 3, 4, 5, 6, 0, 1], STICK: [1, 2, 3, 5, 0, 0, 2, 3]}  # differ from position 3 on
    for _ in range(5):
        common = torch.randn(shared + 1, vocab, requires_grad=True)  # the shared start and the action word
        tails = {a: torch.randn(tail, vocab, requires_grad=True) for a in calls}  # each call's own context

        def log_p(a):
            logits = torch.cat([common, tails[a]])
            return torch.log_softmax(logits, -1)[torch.arange(len(calls[a])), torch.tensor(calls[a])].sum()

        params = [common, *tails.values()]
        truth = torch.autograd.grad(weight * torch.logsumexp(torch.stack([log_p(HIT), log_p(STICK)]), 0), params)
        p = {a: float(log_p(a).detach().exp()) for a in calls}
        credit = likelihood_format(weight, [p[HIT] / (p[HIT] + p[STICK]), p[STICK] / (p[HIT] + p[STICK])])
        surrogate = credit[0] * log_p(HIT) + credit[1] * log_p(STICK)
        for a, b in zip(truth, torch.autograd.grad(surrogate, params)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class _Calls(ScoringStub):
    """Writes the hit call with probability 0.3 and the stick call with 0.6 at every prompt."""

    name = "calls"

    async def answer_logprobs_many(self, items, temperature=None, same_kernels=True):
        out = []
        for _, answers in items:
            out.append([[0.0] * (len(a) - 1) + [math.log(0.3 if i == 0 else 0.6)] for i, a in enumerate(answers)])
        return out


def _forced_credits(solution, vocab_chat, **groups):
    """(first-token credit, action-word credit) of the hit and stick calls of one first decision."""
    player = Player(_Calls(), vocab_chat, solution)
    config = GroupConfig(credit="step-counterfactual", group_size=0, decisions="first", **groups)
    deal = asyncio.run(play_step_groups(player, 3, config))
    group = deal.groups[0].group
    out = []
    for row, action in enumerate((HIT, STICK)):
        start, end = trained_spans(group.masks[row])[0]
        ids = group.tokens[row][start:end]
        text = tool_call_text(action)
        idx = action_token_indices(ids, action_char_span(text), vocab_chat.backend.decode)
        out.append((group.advantages[row][start], group.advantages[row][start + idx[0]]))
    return group, out


def test_two_call_groups_carry_the_likelihood_format_credit(solution, vocab_chat):
    """Every token of a forced call carries weight * p(a | a call); the action word adds the same
    decision credit as under the gap credit, so what reads the decision off the action word less
    the first token (fidelity) reads the same number; the group says which format credit it holds."""
    gap_group, gap = _forced_credits(solution, vocab_chat)
    group, likely = _forced_credits(solution, vocab_chat, format_credit="likelihood", format_weight=0.5)
    assert group.generation_params["format_credit"] == "likelihood"
    assert "format_credit" not in gap_group.generation_params
    for (first, action), share in zip(likely, (1 / 3, 2 / 3)):
        assert first == pytest.approx(0.5 * share)
    # the gap credit: both calls get the same (1 - P(valid)) = 0.1
    assert gap[0][0] == gap[1][0] == pytest.approx(0.1)
    for (f1, a1), (f2, a2) in zip(gap, likely):
        assert a1 - f1 == pytest.approx(a2 - f2)
    assert any(abs(a - f) > 1e-3 for f, a in likely)  # the decision is credited at all


def test_likelihood_format_credit_needs_forced_calls():
    with pytest.raises(ValueError, match="--format-credit likelihood"):
        GroupConfig(credit="step-tokens", format_credit="likelihood")
    run = run_cli("process", "--policy", "optimal", "--groups", "1", "--format-credit", "likelihood")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "--format-credit likelihood" in run.stderr


def test_skip_certain_leaves_out_only_tokens_sampled_near_certainly():
    """Tokens sampled with probability >= 1 - certain are masked; the others, and every token of
    a group without sampling logprobs, are trained as before."""
    lp = [MASKED_LOGPROB, MASKED_LOGPROB, -1e-5, -0.4, -2e-4, -3e-3, -1e-9]
    group = read_group({"tokens": [[5, 6, 7, 8, 9, 10, 11]], "masks": [[MASKED, MASKED, 7, 8, 9, 10, 11]],
                        "scores": [1.0], "advantages": [[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]],
                        "inference_logprobs": [lp]})
    bare = read_group({"tokens": [[5, 6, 7, 8]], "masks": [[MASKED, MASKED, 7, 8]], "scores": [1.0],
                       "advantages": [[0.0, 0.0, 1.0, 1.0]]})

    def kept(certain):
        rows = merge_groups([(group, None), (bare, None)], 8, drop_zero=True, certain=certain)
        return sorted(tuple(t for t, m in zip(seq, mask) if m != MASKED) for r in rows
                      for seq, mask in zip(r.tokens, r.masks))

    assert kept(0.0) == [(7, 8), (7, 8, 9, 10, 11)]
    assert kept(1e-3) == [(7, 8), (8, 10)]  # p >= 0.999 left out: -1e-5, -2e-4, -1e-9
    assert kept(1e-2) == [(7, 8), (8,)]


def test_skip_certain_refuses_a_kl_term():
    with pytest.raises(ValueError, match="--skip-certain"):
        TrainConfig(skip_certain=1e-3, kl_coef=0.1)
    run = run_cli("train", "--skip-certain", "0.001", "--kl-coef", "0.1", "--steps", "1")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "--skip-certain" in run.stderr
