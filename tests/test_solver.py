"""The solver against its published values and against Gymnasium itself."""

import math

import numpy as np
import pytest

from blackjack_rl.game.table import Rules, Table
from blackjack_rl.game.solver import HIT, STICK, baselines, dealer_final, solve


def test_default_rules_match_the_known_optimum():
    s = solve(Rules())
    assert s.value == pytest.approx(-0.04656, abs=5e-6)
    assert (s.start.win, s.start.draw, s.start.loss) == pytest.approx((0.4295, 0.0945, 0.4760), abs=5e-5)
    assert s.start.win + s.start.draw + s.start.loss == pytest.approx(1.0, abs=1e-12)


def test_baselines_match_the_known_values():
    refs = baselines(Rules())
    assert refs["always_stick"].value == pytest.approx(-0.1864, abs=5e-5)
    assert refs["random"].value == pytest.approx(-0.3959, abs=5e-5)


def test_dealer_distribution_is_a_distribution():
    for up in range(1, 11):
        dist = dealer_final(up)
        assert sum(dist) == pytest.approx(1.0, abs=1e-12)
        assert min(dist) >= 0.0


def test_textbook_chart_cells():
    s = solve(Rules())
    assert s.best_action((16, 10, False)) == HIT
    assert s.best_action((12, 4, False)) == STICK
    assert s.best_action((12, 2, False)) == HIT
    assert s.best_action((17, 1, False)) == STICK
    assert s.best_action((18, 9, True)) == HIT  # soft 18 against a 9 hits
    assert s.best_action((18, 7, True)) == STICK
    for obs in [(20, 5, False), (11, 6, False), (13, 2, True)]:
        assert s.regret(obs, s.best_action(obs)) == 0.0
        assert s.regret(obs, 1 - s.best_action(obs)) > 0.0


def test_natural_rules_raise_the_value_of_a_natural_only():
    base, nat, sab = solve(Rules()), solve(Rules(natural=True)), solve(Rules(sab=True))
    assert nat.value > base.value and sab.value > base.value
    # Standing on a natural: 1.5x the win under `natural`, never beaten under `sab`.
    q_base = base.q_values((21, 10, True), natural=True)[STICK]
    assert nat.q_values((21, 10, True), natural=True)[STICK] > q_base
    assert sab.q_values((21, 10, True), natural=True)[STICK] > q_base
    # A soft 21 of three cards is not a natural and is valued the same under all rules but sab's.
    assert nat.q_values((21, 10, True))[STICK] == pytest.approx(q_base)


def _monte_carlo(rules: Rules, policy, episodes: int, seed: int) -> np.ndarray:
    table = Table(rules)
    rewards = np.empty(episodes)
    for i in range(episodes):
        obs = table.reset(seed + i)
        while True:
            step = table.step(policy(obs, table.player_is_natural))
            if step.terminated:
                rewards[i] = step.reward
                break
            obs = step.observation
    return rewards


@pytest.mark.parametrize("rules", [Rules(), Rules(natural=True), Rules(sab=True)], ids=["default", "natural", "sab"])
def test_solver_agrees_with_gymnasium_monte_carlo(rules):
    """Optimal play in Gymnasium's own env must return V* within sampling error."""
    s = solve(rules)
    rewards = _monte_carlo(rules, lambda obs, nat: s.best_action(obs, nat), 40_000, seed=123)
    se = rewards.std(ddof=1) / math.sqrt(len(rewards))
    assert abs(rewards.mean() - s.value) < 4 * se, (rewards.mean(), s.value, se)


def test_q_values_agree_with_gymnasium_from_a_fixed_state():
    """Q*(s, a) is an expectation: replaying many deals that reach (16, 10, hard) agrees with it."""
    s = solve(Rules())
    table = Table(Rules())
    got = {STICK: [], HIT: []}
    seed = 0
    while min(len(v) for v in got.values()) < 1500:
        seed += 1
        obs = table.reset(seed)
        if obs != (16, 10, False):
            continue
        action = seed % 2
        step = table.step(action)
        while not step.terminated:
            step = table.step(s.best_action(step.observation))
        got[action].append(step.reward)
    for action, rewards in got.items():
        r = np.asarray(rewards)
        se = r.std(ddof=1) / math.sqrt(len(r))
        assert abs(r.mean() - s.q_values((16, 10, False))[action]) < 4 * se


def test_a_rule_set_is_solved_once_and_its_solution_cannot_be_changed():
    """Players, reports and baselines share one Solution per rule set, so none may alter it."""
    import dataclasses

    s = solve()
    assert solve(Rules()) is s and solve(Rules(natural=True)) is not s
    assert baselines()["optimal"] == s.start
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.start = baselines()["always_stick"]  # type: ignore[misc]
