"""Episodes and groups: how each ending is scored, and how groups are packed."""

import asyncio

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import EpisodeSettings, play_episode, sampling_seed
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.core import pack_group
from blackjack_rl.policies.base import InferenceError, Reply
from blackjack_rl.policies.bots import OptimalBot, RandomBot, ThresholdBot
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.contract.tokens import MASKED


class Scripted:
    """Answers from a list of texts (or raises), to drive every branch of an episode."""

    name = "scripted"

    def __init__(self, answers):
        self.answers = list(answers)

    def generation_params(self):
        return {"policy": self.name}

    async def respond(self, turn):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return Reply(text=answer)

    async def aclose(self):
        pass


def run(coro):
    return asyncio.run(coro)


def test_a_finished_game_scores_the_gymnasium_reward(vocab_chat, solution):
    table = Table(Rules())
    for seed in range(30):
        ep = run(play_episode(table, OptimalBot(solution), vocab_chat, solution, seed))
        assert ep.status == "finished"
        assert ep.score == ep.reward and ep.reward in (-1.0, 0.0, 1.0)
        assert ep.outcome == {1.0: "win", 0.0: "draw", -1.0: "loss"}[ep.reward]
        assert all(d.regret == 0.0 and d.action == d.optimal for d in ep.decisions)
        # replaying the deal with the same actions in plain gymnasium gives the same reward
        import gymnasium as gym

        # explicit rules: the registered Blackjack-v1 spec defaults to sab=True
        env = gym.make("Blackjack-v1", natural=False, sab=False)
        env.reset(seed=seed)
        for d in ep.decisions:
            _, r, term, _, _ = env.step(d.action_id)
        assert term and r == ep.reward


def test_invalid_answer_ends_the_episode_with_the_invalid_score(vocab_chat, solution):
    ep = run(play_episode(Table(), Scripted(["I think I will hit."]), vocab_chat, solution, 1,
                          settings=EpisodeSettings(invalid_score=-0.5)))
    assert (ep.status, ep.invalid_reason, ep.score, ep.reward, ep.outcome) == ("invalid", "no_call", -0.5, None, None)
    assert ep.decisions[0].action is None and ep.decisions[0].parse_error == "no_call"
    # the invalid answer is still in the trajectory: it is what training must discourage
    assert any(m != MASKED for m in ep.trajectory.masks)


@pytest.mark.parametrize("answer,reason", [
    ('<tool_call>{"name": "take_action", "arguments": {"action": "double"}}</tool_call>', "bad_action"),
    ('<tool_call>{"name": "fold", "arguments": {"action": "hit"}}</tool_call>', "wrong_tool"),
    ('<tool_call>{"name": "take_action", "arguments": </tool_call>', "bad_json"),
])
def test_each_invalid_reason_is_recorded(vocab_chat, solution, answer, reason):
    ep = run(play_episode(Table(), Scripted([answer]), vocab_chat, solution, 2))
    assert ep.status == "invalid" and ep.invalid_reason == reason and ep.score == -1.0


def test_inference_failure_fails_the_episode_and_is_never_scored(vocab_chat, solution):
    policy = Scripted([tool_call_text(HIT), InferenceError("HTTP 400: context too long")])
    # seed 0 of many: find one where a hit does not end the game, so the failure happens on turn 2
    for seed in range(50):
        policy.answers = [tool_call_text(HIT), InferenceError("HTTP 400: context too long")]
        ep = run(play_episode(Table(), policy, vocab_chat, solution, seed))
        if len(ep.decisions) == 1 and ep.status == "failed":
            break
    assert ep.status == "failed" and ep.score is None and ep.outcome is None
    assert "HTTP 400" in ep.error


def test_a_crashing_policy_fails_the_episode_not_the_run(vocab_chat, solution):
    ep = run(play_episode(Table(), Scripted([RuntimeError("boom")]), vocab_chat, solution, 3))
    assert ep.status == "failed" and "boom" in ep.error


def test_turn_and_token_budgets(vocab_chat, solution):
    always_hit = Scripted([tool_call_text(HIT)])
    cut = None
    for seed in range(200):
        ep = run(play_episode(Table(), always_hit, vocab_chat, solution, seed, settings=EpisodeSettings(max_turns=1)))
        if ep.status == "truncated":
            cut = ep
            break
    assert cut is not None and cut.invalid_reason == "turn_limit" and cut.score == -1.0
    # a token budget smaller than prompt + one answer stops before asking the model anything
    prompt_len = len(vocab_chat.prompt_ids(cut.messages[:2]))
    ep = run(play_episode(Table(), always_hit, vocab_chat, solution, 0,
                          settings=EpisodeSettings(max_token_length=prompt_len + 10, max_new_tokens=64)))
    assert ep.status == "truncated" and ep.invalid_reason == "context_limit" and not ep.decisions


def test_sampling_seeds_differ_per_episode_and_turn_and_are_stable():
    seeds = {sampling_seed(7, i, t) for i in range(16) for t in range(5)}
    assert len(seeds) == 80
    assert sampling_seed(7, 3, 1) == sampling_seed(7, 3, 1)


def test_group_shares_the_deal_and_the_prompt(vocab_chat, solution):
    player = Player(RandomBot(), vocab_chat, solution)
    result = run(play_group(player, 11, GroupConfig(group_size=8)))
    g = result.group
    assert g is not None and len(g.tokens) == len(g.masks) == len(g.scores) == 8
    first_trained = [m.index(next(x for x in m if x != MASKED)) for m in g.masks]
    assert len(set(first_trained)) == 1
    prompts = {tuple(t[: first_trained[0]]) for t in g.tokens}
    assert len(prompts) == 1
    for toks, masks, lps in zip(g.tokens, g.masks, g.inference_logprobs):
        assert len(toks) == len(masks) == len(lps)
        assert all(m in (MASKED, t) for t, m in zip(toks, masks))
    assert {e.seed for e in g.episodes} == {11}
    assert g.scores == [e.score for e in g.episodes]
    # random play on one deal: the actions differ between episodes
    assert len({tuple(e.actions) for e in g.episodes}) > 1


def test_group_with_a_failed_episode_is_not_emitted(vocab_chat, solution):
    class FlakyEverySecond(Scripted):
        calls = 0

        async def respond(self, turn):
            FlakyEverySecond.calls += 1
            if FlakyEverySecond.calls % 2 == 0:
                raise InferenceError("timeout")
            return Reply(text=tool_call_text(STICK))

    result = run(play_group(Player(FlakyEverySecond([]), vocab_chat, solution), 5, GroupConfig(group_size=4)))
    assert result.group is None and result.dropped == "failed_episodes"
    assert sum(ep.failed for ep in result.episodes) == 2


def test_equal_score_groups_can_be_dropped(vocab_chat, solution):
    player = Player(ThresholdBot(17), vocab_chat, solution)  # deterministic: all 4 episodes play alike
    assert run(play_group(player, 3, GroupConfig(group_size=4, drop_equal_scores=True))).dropped == "equal_scores"
    assert run(play_group(player, 3, GroupConfig(group_size=4, drop_equal_scores=False))).group is not None


def test_packing_refuses_groups_from_different_deals(vocab_chat, solution):
    player = Player(OptimalBot(solution), vocab_chat, solution)
    a, b = run(player.episode(1)), run(player.episode(2))
    assert a.messages[1] != b.messages[1]  # two deals, two first hands
    with pytest.raises(ValueError, match="share their prompt"):
        pack_group([a.trajectory, b.trajectory], [0.0, 0.0], [a.messages, b.messages], [a.record(), b.record()], {})


def test_limiter_at_one_does_not_deadlock(vocab_chat, solution):
    player = Player(RandomBot(), vocab_chat, solution)

    async def main():
        limiter = asyncio.Semaphore(1)
        return await asyncio.wait_for(
            asyncio.gather(*(play_group(player, s, GroupConfig(group_size=4), limiter=limiter) for s in range(5))), timeout=30)

    assert all(r.group is not None for r in run(main()))


def test_an_evaluation_keeps_only_its_concurrency_of_episodes_in_flight(vocab_chat, solution):
    """Deals start as others end: a task per deal up front held a million of them before one played."""
    from blackjack_rl.rollout.runner import DealRunner, run_evaluation

    alive = []

    def count(ep):
        alive.append(len(asyncio.all_tasks()))

    async def both():
        player = Player(OptimalBot(solution), vocab_chat, solution, EpisodeSettings())
        few = await DealRunner(player, GroupConfig(), 4).evaluation(300, on_episode=count)
        one_by_one = await run_evaluation(player, 300, concurrency=1)
        return few, one_by_one

    few, one_by_one = run(both())
    assert len(few) == 300 and max(alive) <= 4 + 1  # the episodes' tasks and the test's own
    assert [ep.seed for ep in few] == [ep.seed for ep in one_by_one] == sorted(ep.seed for ep in few)
    assert [ep.sample_row().to_json() for ep in few] == [ep.sample_row().to_json() for ep in one_by_one]
