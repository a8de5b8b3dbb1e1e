"""Per-decision credit: the `expected` scoring mode, step groups and thinking mode."""

import asyncio
import math
import statistics

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import EpisodeSettings, play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot, RandomBot, ThresholdBot
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.rollout.stepgroups import play_step_groups
from blackjack_rl.contract.tokens import MASKED, trained_spans
from scripted import Scripted


def run(coro):
    return asyncio.run(coro)


def play_many(policy, chat, solution, n, settings=EpisodeSettings()):
    async def main():
        table = Table(Rules())
        return [await play_episode(table, policy, chat, solution, seed, 0, settings) for seed in range(n)]

    return run(main())


@pytest.mark.parametrize("make_bot", [lambda s: OptimalBot(s), lambda s: ThresholdBot(17)], ids=["optimal", "threshold17"])
def test_expected_has_the_outcome_mean_and_far_lower_variance(vocab_chat, solution, make_bot):
    eps = play_many(make_bot(solution), vocab_chat, solution, 6000)
    outcome = [ep.scores["outcome"] for ep in eps]
    expected = [ep.scores["expected"] for ep in eps]
    diffs = [o - e for o, e in zip(outcome, expected)]  # paired: same deals
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    assert abs(statistics.fmean(diffs)) < 4 * se
    assert statistics.variance(expected) < 0.25 * statistics.variance(outcome)
    if isinstance(make_bot(solution), OptimalBot):
        # optimal play: every decision has zero regret, so the score is V*(s0) itself
        assert all(ep.scores["expected"] == ep.start_value for ep in eps)
        mean_v0 = statistics.fmean(expected)
        assert abs(mean_v0 - solution.value) < 4 * statistics.stdev(expected) / math.sqrt(len(expected))


def test_expected_score_is_v0_minus_regret(vocab_chat, solution):
    for ep in play_many(RandomBot(), vocab_chat, solution, 200):
        assert ep.status == "finished"
        regret = sum(d.regret for d in ep.decisions)
        assert ep.scores["expected"] == pytest.approx(ep.start_value - regret)
        first = ep.decisions[0]
        assert ep.start_value == solution.v(first.observation, first.natural)


def test_scoring_mode_selects_the_training_score_and_bonus_rewards_format(vocab_chat, solution):
    settings = EpisodeSettings(scoring="expected", format_bonus=0.1)
    for ep in play_many(OptimalBot(solution), vocab_chat, solution, 20, settings):
        assert ep.score == ep.scores["expected"] == pytest.approx(ep.start_value + 0.1)


def test_step_groups_score_each_answer_by_q_star(vocab_chat, solution):
    # answers alternate hit / stick / garbage, so each group holds all three kinds
    kinds = [tool_call_text(HIT), tool_call_text(STICK), "no idea"]
    player = Player(Scripted(lambda t: kinds[(t.seed >> 3) % 3]), vocab_chat, solution,
                    EpisodeSettings(invalid_score=-1.5))
    checked = 0
    for seed in range(40):
        deal = run(play_step_groups(player, seed, GroupConfig(credit="step", group_size=6, continue_with="best")))
        for result in deal.groups:
            g = result.group
            prompt_len = trained_spans(g.masks[0])[0][0]
            prompts = {tuple(t[:prompt_len]) for t in g.tokens}
            assert len(prompts) == 1  # byte-identical prompt across the group
            for tokens, masks, score, meta in zip(g.tokens, g.masks, g.scores, g.episodes):
                spans = trained_spans(masks)
                assert len(spans) == 1 and spans[0][1] == len(tokens)  # shared prompt + one answer
                answer = vocab_chat.backend.decode(tokens[spans[0][0]:])
                q = solution.q_values(meta.state, meta.natural)
                if meta.action is None:
                    assert score == -1.5 and answer == "no idea<|im_end|>"
                else:
                    action = HIT if meta.action == "hit" else STICK
                    assert score == q[action] and answer == tool_call_text(action) + "<|im_end|>"
                checked += 1
    assert checked > 100


def _mixed_answer(turn):
    """Seeded per answer: an invalid answer, a hit or a stick, so group members differ in score."""
    import random

    u = random.Random(turn.seed).random()
    return "no idea" if u < 0.3 else tool_call_text(HIT if u < 0.65 else STICK)


@pytest.mark.parametrize("group_size", [1, 4])
def test_step_groups_continue_with_the_best_answer(vocab_chat, solution, group_size):
    """The rule: at every decision the canonical episode goes on with an answer of the highest
    score in its group. Which answer was played is read off the next group's shared prompt."""
    player = Player(Scripted(_mixed_answer), vocab_chat, solution)
    best_was_not_first = invalid_ends = 0
    for seed in range(60):
        deal = run(play_step_groups(player, seed, GroupConfig(credit="step", group_size=group_size, continue_with="best")))
        groups = [r.group for r in deal.groups]
        assert groups and all(g is not None for g in groups)
        for k, group in enumerate(groups):
            scores = group.scores
            best = max(scores)
            meta = group.episodes
            if k + 1 < len(groups):
                following = groups[k + 1].tokens[0]
                played = [j for j, tokens in enumerate(group.tokens) if following[:len(tokens)] == tokens]
                assert played and all(scores[j] == best for j in played), (seed, k, scores, played)
                # the state the next group was sampled in follows from the best action
                q = meta[0].q
                assert meta[played[0]].action is not None and q[meta[played[0]].action] == best
                best_was_not_first += scores[0] < best
            elif deal.status == "invalid":  # the episode ends on an invalid answer only if all were invalid
                assert all(m.action is None for m in meta)
                invalid_ends += 1
            else:
                assert deal.status == "finished" and any(m.action is not None for m in meta)
    if group_size > 1:
        assert best_was_not_first > 5  # the rule is tested where it differs from playing the first answer
    assert invalid_ends > 0  # and where no answer was valid


def test_thinking_mode_cuts_old_thoughts_to_fit_the_budget(vocab_chat, solution):
    long_thought = "<think>" + "I count the cards and weigh the odds. " * 25 + "</think>\n"
    always_hit = Scripted(lambda t: long_thought + tool_call_text(HIT if t.observation.player_sum < 19 else STICK))
    settings = EpisodeSettings(thinking=True, max_token_length=700, max_new_tokens=280)
    eps = play_many(always_hit, vocab_chat, solution, 60, settings)
    assert any(ep.thoughts_truncated for ep in eps)
    for ep in eps:
        assert len(ep.trajectory.tokens) <= 700
        assert ep.status in ("finished", "truncated")
        if ep.thoughts_truncated:
            # answers sampled before the cut are context now; the ones after it are trained in full
            spans = trained_spans(ep.trajectory.masks)
            for a, b in spans:
                assert vocab_chat.backend.decode(ep.trajectory.tokens[a:b]).startswith("<think>")
            stripped = [m for m in ep.messages if m["role"] == "assistant" and not m["content"].startswith("<think>")]
            assert stripped and all(m["content"].startswith("<tool_call>") for m in stripped)
    assert "<think>" in eps[0].messages[0]["content"]  # the system prompt asks for reasoning


@pytest.mark.parametrize("answer,status", [
    ("<think>I should hit" , "invalid"),                                  # unclosed: never answered
    (tool_call_text(STICK), "finished"),                                  # no think block: still a valid call
    ("I reason without tags</think>" + tool_call_text(STICK), "finished"),  # opening tag in the prompt
    ("<think>maybe " + tool_call_text(HIT) + "</think>no call", "invalid"),  # a drafted call is not the decision
])
def test_thinking_is_robust_to_malformed_blocks(vocab_chat, solution, answer, status):
    ep = play_many(Scripted(lambda t: answer), vocab_chat, solution, 1, EpisodeSettings(thinking=True))[0]
    assert ep.status == status


@pytest.mark.embedded
def test_step_groups_on_the_embedded_model(embedded, solution):
    player = Player(embedded, embedded.chat, solution, EpisodeSettings(max_new_tokens=48))
    deal = run(play_step_groups(player, 77, GroupConfig(credit="step", group_size=3)))
    assert deal.groups
    g = deal.groups[0].group
    prompt_len = min(m.index(next(x for x in m if x != MASKED)) for m in g.masks)
    assert len({tuple(t[:prompt_len]) for t in g.tokens}) == 1
    for tokens, masks, lps in zip(g.tokens, g.masks, g.inference_logprobs):
        answer = tokens[prompt_len:]
        if len(answer) == 48 + 1:  # cut at max_new_tokens: the template's end-of-turn is context, not trained
            assert masks[-1] == MASKED and answer[-1] == 2
            answer, masks, lps = answer[:-1], masks[:-1], lps[:-1]
        assert masks[prompt_len:] == answer and all(lp <= 0 for lp in lps[prompt_len:])


@pytest.mark.embedded
def test_thinking_mode_on_the_embedded_model_fits_the_budget(embedded, solution):
    """Whatever the model writes (it rarely closes its thoughts), no sequence exceeds the budget."""
    settings = EpisodeSettings(thinking=True, max_token_length=520, max_new_tokens=48)
    player = Player(embedded, embedded.chat, solution, settings)
    for seed in range(3):
        ep = run(player.episode(seed))
        assert ep.status != "failed" and len(ep.trajectory.tokens) <= 520
        assert "<think>" in ep.messages[0]["content"]
    deal = run(play_step_groups(player, 5, GroupConfig(credit="step", group_size=2)))
    assert all(len(t) <= 520 for r in deal.groups for t in r.group.tokens)
