"""The SkyRL-gym adapter, made through skyrl-gym's own registry."""

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="the skyrl extra is not installed (pip install -e '.[skyrl]')")

from blackjack_rl.adapters.skyrl_env import BlackjackSkyRLEnv, dataset_rows  # noqa: E402
from blackjack_rl.env import BlackjackEnv, EnvSettings  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402


def test_make_plays_the_rows_deal_with_our_rewards():
    core = BlackjackEnv(solve(Rules()), EnvSettings(scoring="expected", format_bonus=0.2))
    for row in dataset_rows(range(10), scoring="expected", format_bonus=0.2):
        env = skyrl_gym.make("blackjack_rl", env_config={}, extras=row)
        assert isinstance(env, BlackjackSkyRLEnv)
        prompt, _ = env.init(row["prompt"])
        assert prompt == row["prompt"] == core.reset(row["seed"])[0]
        done = False
        while not done:
            answer = tool_call_text(HIT if core.observation.player_sum < 13 else STICK)
            out = env.step(answer)
            text, reward, terminated, truncated, info = core.step(answer)
            done = out["done"]
            assert (out["reward"], done) == (reward, terminated or truncated)
            assert out["observations"] == ([] if done else [{"role": "user", "content": text}])
            assert out["metadata"]["parse"] == info["parse"]
        assert env.get_metrics()["score"] == core.play.score


def test_settings_ride_in_the_env_config_and_extra_info():
    env = skyrl_gym.make("blackjack_rl", env_config={"invalid_retries": 1},
                         extras={"extra_info": {"seed": 4, "natural": True}})
    assert env.env.rules == Rules(natural=True) and env.env.settings.invalid_retries == 1
    env.init(None)
    assert env.step("no call")["done"] is False


def test_a_row_without_a_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        skyrl_gym.make("blackjack_rl", env_config={}, extras={})
