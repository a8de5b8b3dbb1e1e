"""The Gymnasium adapter, checked by Gymnasium's own env checker."""

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import blackjack_rl.adapters  # noqa: F401  (registers the id)
from blackjack_rl.env import BlackjackEnv, EnvSettings
from blackjack_rl.game.table import Rules
from blackjack_rl.contract.protocol import STICK, tool_call_text
from blackjack_rl.game.solver import solve

ENV_ID = "blackjack_rl/BlackjackText-v0"


@pytest.mark.parametrize("natural,sab", [(False, False), (True, False), (False, True)])
def test_registered_env_passes_gymnasiums_checker(natural, sab):
    env = gymnasium.make(ENV_ID, natural=natural, sab=sab)
    assert env.unwrapped.env.rules == Rules(natural=natural, sab=sab)
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_same_seed_same_deal_and_rewards_as_the_core_env():
    env = gymnasium.make(ENV_ID, scoring="expected")
    core = BlackjackEnv(solve(Rules()), EnvSettings(scoring="expected"))
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        messages, core_info = core.reset(seed)
        assert obs == messages[-1]["content"] and info["messages"] == messages and info["q"] == core_info["q"]
        assert env.observation_space.contains(obs)
        answer = tool_call_text(STICK)
        assert env.step(answer)[1:] == core.step(answer)[1:]


def test_a_reprompt_quoting_odd_characters_stays_in_the_observation_space():
    env = gymnasium.make(ENV_ID, invalid_retries=1)
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step('<tool_call>{"name": "take_actión", "arguments": {}}</tool_call>')
    assert not terminated and info["retries"] == 1
    assert env.observation_space.contains(obs)
