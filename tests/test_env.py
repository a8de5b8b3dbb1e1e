"""BlackjackEnv: the one game loop that episodes, evaluation and every adapter drive."""

import asyncio

import pytest

from helpers import deal_groups
from blackjack_rl.config import GroupConfig
from blackjack_rl.env import BlackjackEnv, EnvSettings
from blackjack_rl.rollout.episodes import EpisodeSettings, play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.policies.base import Reply
from blackjack_rl.contract.protocol import HIT, STICK, observation_text, system_prompt, tool_call_text


def test_reset_deals_the_seed_and_shows_the_prompt(solution):
    env = BlackjackEnv(solution)
    messages, info = env.reset(12)
    table = Table(Rules())
    obs = table.reset(12)
    assert messages == [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": observation_text(*obs)},
    ]
    q_stick, q_hit = solution.q_values(obs, table.player_is_natural)
    assert info["q"] == {"hit": q_hit, "stick": q_stick}
    assert info["optimal"] == ("hit" if q_hit > q_stick else "stick")
    assert info["start_value"] == max(q_hit, q_stick)
    assert env.reset(12)[0] == messages


def test_rewards_sum_to_the_recorded_score(solution):
    env = BlackjackEnv(solution, EnvSettings(scoring="expected", format_bonus=0.5))
    for seed in range(40):
        env.reset(seed)
        rewards, text = [], "start"
        while text is not None:
            text, reward, terminated, truncated, info = env.step(tool_call_text(HIT if env.observation.player_sum < 15 else STICK))
            rewards.append(reward)
            assert info["parse"]["valid"] and not truncated
        assert terminated and all(r == 0.0 for r in rewards[:-1])
        play = env.play
        assert rewards[-1] == play.score == play.scores["expected"]
        regret = sum(d.regret for d in play.decisions)
        assert play.score == pytest.approx(play.start_value - regret + 0.5)
        assert play.scores["outcome"] == play.reward + 0.5


@pytest.mark.parametrize("answer", ["", "I stick.", "<tool_call>{\"name\": \"take_action\"", None, b"\xff\xfe", "{" * 5000])
def test_an_invalid_answer_ends_the_episode_with_the_invalid_score(solution, answer):
    env = BlackjackEnv(solution, EnvSettings(invalid_score=-1.5))
    env.reset(3)
    text, reward, terminated, truncated, info = env.step(answer)
    assert (text, reward, terminated, truncated) == (None, -1.5, True, False)
    assert info["status"] == "invalid" and info["parse"]["valid"] is False
    assert info["invalid_reason"] == info["parse"]["error"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(tool_call_text(STICK))


def test_invalid_answers_are_reprompted_up_to_the_limit_then_forfeit(solution):
    env = BlackjackEnv(solution, EnvSettings(invalid_retries=2, format_bonus=1.0))
    messages, _ = env.reset(7)
    for attempt in (1, 2):
        text, reward, terminated, truncated, info = env.step("hit please")
        assert not terminated and not truncated and reward == 0.0
        assert info["retries"] == attempt and "no_call" in text and text.endswith(messages[-1]["content"])
    text, reward, terminated, _, info = env.step("still no call")
    assert terminated and info["status"] == "invalid" and info["retries"] == 2
    assert reward == -1.0  # no answer was well-formed: no bonus


def test_a_reprompted_episode_can_still_finish(solution):
    env = BlackjackEnv(solution, EnvSettings(invalid_retries=1, format_bonus=1.0))
    env.reset(7)
    env.step("nonsense")
    text, reward, terminated, _, info = env.step(tool_call_text(STICK))
    assert terminated and info["status"] == "finished"
    assert reward == env.play.reward + 0.5  # one of two answers was well-formed
    assert env.play.retries == 1 and len(env.play.decisions) == 2


def test_the_turn_limit_truncates_and_still_shows_the_hand(solution):
    env = BlackjackEnv(solution, EnvSettings(max_turns=1))
    seed = next(s for s in range(100) if Table(Rules()).reset(s).player_sum <= 11)  # a hit cannot bust
    env.reset(seed)
    text, reward, terminated, truncated, info = env.step(tool_call_text(HIT))
    assert truncated and not terminated and text == observation_text(*env.observation)
    assert info["status"] == "truncated" and info["invalid_reason"] == "turn_limit" and reward == -1.0


def test_the_option_is_checked(solution):
    with pytest.raises(ValueError, match="invalid_retries"):
        EnvSettings(invalid_retries=-1)
    with pytest.raises(ValueError, match="solution"):
        BlackjackEnv(solution, table=Table(Rules(natural=True)))


class Scripted:
    name = "scripted"

    def __init__(self, answers):
        self.answers = answers

    def generation_params(self):
        return {}

    async def respond(self, turn):
        return Reply(self.answers.pop(0))

    async def aclose(self):
        pass


def test_episodes_record_the_reprompts(vocab_chat, solution):
    policy = Scripted(["no idea", tool_call_text(STICK)])
    ep = asyncio.run(play_episode(Table(), policy, vocab_chat, solution, 7, settings=EpisodeSettings(invalid_retries=1)))
    assert ep.status == "finished" and ep.retries == 1 and ep.record().retries == 1
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "no_call" in ep.messages[3]["content"]


def test_exploring_starts_put_the_player_in_the_state_and_keep_the_seeds_cards():
    import random

    from blackjack_rl.game.table import Observation, hand_in_state
    from blackjack_rl.measure.grid import GRID_STATES

    for s, d, u in GRID_STATES:
        for k in range(5):
            hand = hand_in_state(s, u, random.Random(k))
            total = sum(hand) + (10 if 1 in hand and sum(hand) + 10 <= 21 else 0)
            assert (total, 1 in hand and sum(hand) + 10 == total) == (s, u)
            assert sorted(hand) != [1, 10] and all(1 <= c <= 10 for c in hand)  # never a natural
    table = Table()
    for seed in range(20):
        table.reset(seed)
        dealt_card = table.step(HIT).observation  # the seed's next card, drawn after the deal
        natural_hand = table.player_hand
        start = Observation(13, 1, True)
        assert table.reset(seed, start) == start
        table.step(HIT)
        assert table.player_hand[-1] == natural_hand[-1], dealt_card
        assert table.dealer_hand[0] == 1


def test_balanced_starts_cover_the_chart_half_hit_optimal(solution):
    from blackjack_rl.game.solver import GRID_STATES
    from blackjack_rl.rollout.stepgroups import balanced_start

    starts = [balanced_start(seed, solution) for seed in range(4000)]
    hit = sum(solution.best_action(k) == HIT for k in starts)
    assert 0.45 < hit / len(starts) < 0.55  # the deal distribution's first decisions: 53% / 47%
    assert set(starts) == set(GRID_STATES)
    assert starts == [balanced_start(seed, solution) for seed in range(4000)]  # reproducible


def test_step_groups_with_chart_starts_begin_in_the_drawn_state(vocab_chat, solution):
    from blackjack_rl.rollout.stepgroups import balanced_start
    from blackjack_rl.rollout.players import Player
    from blackjack_rl.policies.bots import OptimalBot

    player = Player(OptimalBot(solution), vocab_chat, solution, EpisodeSettings())
    config = GroupConfig(credit="step-tokens", group_size=2, starts="chart")
    for seed in range(10):
        first = deal_groups(player, seed, config)[0].group.episodes[0]
        assert tuple(first.state) == tuple(int(x) for x in balanced_start(seed, solution))
    with pytest.raises(ValueError, match="--starts is for step groups"):
        GroupConfig(starts="chart")


def test_first_decision_step_groups_stop_after_the_first_group(vocab_chat, solution):
    from blackjack_rl.rollout.players import Player
    from blackjack_rl.policies.bots import OptimalBot

    player = Player(OptimalBot(solution), vocab_chat, solution, EpisodeSettings())
    counts = {}
    for decisions in ("all", "first"):
        config = GroupConfig(credit="step", group_size=2, starts="chart", decisions=decisions)
        deals = [deal_groups(player, seed, config) for seed in range(30)]
        counts[decisions] = [len(d) for d in deals]
        assert all(d[0].group.episodes[0].decision == 0 for d in deals)
    assert max(counts["all"]) > 1  # optimal play hits on about half of these starts
    assert counts["first"] == [1] * 30
    with pytest.raises(ValueError, match="--decisions is for step groups"):
        GroupConfig(decisions="first")
