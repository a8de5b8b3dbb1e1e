"""The exact whole-game value (measure/tree.py): against the solver for stationary bots, against
closed forms and an independent recursion for policies that read the history, and the
certified interval when the budget does not cover the tree."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.game.solver import CARD_PROBS, after_hit, policy_outcome, solve, stick_outcome
from blackjack_rl.game.table import Observation, Rules, Table
from blackjack_rl.measure.grid import GRID_STATES, evaluate_grid
from blackjack_rl.measure.probe import exact_game, exact_grid, history_ids, node_policy, probe_policy
from blackjack_rl.measure.tree import deals, evaluate_game, hit_value, is_natural, most_decisions, outcome_bounds, outcome_range
from blackjack_rl.policies.base import Reply
from blackjack_rl.policies.bots import OptimalBot, RandomBot, ThresholdBot
from blackjack_rl.rollout.episodes import opening_messages, play_episode
from blackjack_rl.rollout.players import Player


def run(coro):
    return asyncio.run(coro)


def by_history(f):
    """A node policy from `f(history) -> (P(hit), P(stick))`."""
    async def policy(histories):
        return [f(h) for h in histories]

    return policy


def stationary(hit):
    """A node policy from the solver's form `hit(sum, dealer, usable_ace, natural)`: blind to the history."""
    def f(h):
        p = hit(*h[-1], is_natural(h))
        return p, 1.0 - p

    return by_history(f)


def first_states():
    return deals().items()


# --------------------------------------------------------------------------- stationary bots: the solver's values


def test_the_optimal_bots_whole_game_is_v_star(solution):
    g = run(exact_game(Player(OptimalBot(solution), None, solution)))
    assert g["complete"] and g["width"] == 0.0 and g["unexplored_mass"] == 0.0
    assert abs(g["value"] - solution.value) < 1e-9
    assert g["first_accuracy"] == 1.0 and g["after_hit_accuracy"] == 1.0 == g["after_hit_accuracy_valid"]
    assert 0.5 < g["stick_after_hit_accuracy"] < 0.8  # sticking after a hit is often, not always, right
    # the env's turn limit truncates a handful of hands: the only, tiny, difference from the solver
    assert 0.0 < g["p_invalid"] < 1e-10


@pytest.mark.parametrize("threshold", [4, 12, 15, 17])
def test_a_threshold_bots_whole_game_is_its_solver_value(solution, threshold):
    g = run(exact_game(Player(ThresholdBot(threshold), None, solution)))
    exact = policy_outcome(Rules(), lambda s, d, u, n: float(s < threshold)).value
    assert g["complete"] and g["width"] == 0.0
    assert abs(g["value"] - exact) < 1e-9


def test_stochastic_stationary_play_and_paying_naturals_match_the_solver():
    """A random bot hits at every history, so its tree (8 million histories) is covered only in
    part (next test); a random policy that stops hitting at 16 has a small one."""
    def hit(s, d, u, n):
        return 0.5 if s < 13 else 0.2 if s < 16 else 0.0

    for rules in (Rules(), Rules(natural=True), Rules(sab=True)):
        sol = solve(rules)
        g = run(evaluate_game(sol, stationary(hit)))
        assert g.complete and g.width == 0.0
        assert abs(g.value - policy_outcome(rules, hit).value) < 1e-9


def test_the_random_bots_interval_holds_its_solver_value(solution):
    g = run(exact_game(Player(RandomBot(), None, solution), budget=20_000))
    exact = policy_outcome(Rules(), lambda s, d, u, n: 0.5).value
    assert not g["complete"] and g["nodes"] == 20_000
    assert g["value_low"] <= exact <= g["value_high"] and g["width"] < 0.02
    assert g["first_accuracy"] == pytest.approx(0.5) and g["after_hit_accuracy"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- play that reads the history


def _q_stick(obs, natural=False, rules=Rules()):
    return stick_outcome(obs.player_sum, obs.dealer_card, natural, rules).value


def test_hitting_only_at_the_first_decision_has_its_closed_form(solution):
    def hit(obs):
        return 0.3 + 0.04 * (obs.player_sum % 11)

    g = run(evaluate_game(solution, by_history(lambda h: (hit(h[0]), 1 - hit(h[0])) if len(h) == 1 else (0.0, 1.0))))
    exact = 0.0
    for obs, p in first_states():
        after = sum(q * (-1.0 if s > 21 else _q_stick(Observation(s, obs.dealer_card, u)))
                    for c, q in CARD_PROBS for s, u in [after_hit(obs.player_sum, obs.usable_ace, c)])
        exact += p * ((1 - hit(obs)) * _q_stick(obs, is_natural((obs,))) + hit(obs) * after)
    assert g.complete and abs(g.value - exact) < 1e-12
    assert g.max_depth == 1 and g.after_hit_accuracy_valid == g.after_hit_accuracy  # no invalid mass


@pytest.mark.parametrize("invalid_score", [-1.0, -2.0])
def test_always_invalid_after_a_hit_has_its_closed_form(solution, invalid_score):
    def first(obs):
        h = float(solution.best_action(obs, is_natural((obs,))) == HIT)
        return 0.9 * h, 0.9 * (1 - h)  # a tenth of first answers invalid too

    g = run(evaluate_game(solution, by_history(lambda h: first(h[0]) if len(h) == 1 else (0.0, 0.0)),
                          invalid_score=invalid_score))
    exact = 0.0
    for obs, p in first_states():
        p_hit, p_stick = first(obs)
        bust = sum(q for c, q in CARD_PROBS if after_hit(obs.player_sum, obs.usable_ace, c)[0] > 21)
        exact += p * (p_stick * _q_stick(obs, is_natural((obs,))) + 0.1 * invalid_score
                      + p_hit * (-bust + (1 - bust) * invalid_score))
    assert g.complete and abs(g.value - exact) < 1e-12
    assert g.first_accuracy == pytest.approx(0.9) and g.first_accuracy_valid == pytest.approx(1.0)
    assert g.after_hit_accuracy == 0.0 and g.after_hit_accuracy_valid is None  # no valid answer after a hit


def _recursive_value(solution, f, history, invalid_score, max_turns):
    """The same value by plain recursion over the draws: an independent check of the heap's sums."""
    obs, depth = history[-1], len(history) - 1
    p_hit, p_stick = f(history)
    value = p_stick * _q_stick(obs, is_natural(history)) + (1 - p_hit - p_stick) * invalid_score
    for card, q in CARD_PROBS if p_hit else ():
        s, u = after_hit(obs.player_sum, obs.usable_ace, card)
        if s > 21:
            value -= p_hit * q
        elif depth + 1 >= max_turns:
            value += p_hit * q * invalid_score
        else:
            value += p_hit * q * _recursive_value(solution, f, (*history, Observation(s, obs.dealer_card, u)),
                                                  invalid_score, max_turns)
    return value


def test_play_that_changes_with_depth_and_the_path_agrees_with_a_recursion(solution):
    """P(hit) falls with each hit and depends on the first hand too; a fifth of later answers
    are invalid; the turn limit (3 answers here) truncates."""
    def f(h):
        base = 0.8 if h[-1].player_sum < 16 else 0.3
        p_hit = base / len(h) * (0.5 if h[0].usable_ace else 1.0)
        p_valid = 1.0 if len(h) == 1 else 0.8
        return p_valid * p_hit, p_valid * (1 - p_hit)

    g = run(evaluate_game(solution, by_history(f), invalid_score=-1.5, max_turns=3))
    exact = sum(p * _recursive_value(solution, f, (obs,), -1.5, 3) for obs, p in first_states())
    assert g.complete and abs(g.value - exact) < 1e-12 and g.max_depth == 2
    assert g.p_invalid > 0.0


# --------------------------------------------------------------------------- the certified interval


def test_the_bounds_are_the_worst_and_best_play(solution):
    bounds = outcome_bounds(Rules(), -1.0)
    for key, (w, b) in bounds.items():
        assert w == -1.0 and b == pytest.approx(max(solution.q[key]), abs=1e-12)
    assert outcome_range(Rules(), -1.0) == (-1.0, 1.0) and outcome_range(Rules(natural=True), -2.0) == (-2.0, 1.5)


@pytest.mark.parametrize("invalid_score", [-1.0, -2.0])
def test_a_small_budget_gives_an_interval_that_holds_the_value(solution, invalid_score):
    def f(h):  # hit below 14, a twentieth of answers invalid
        p_hit = float(h[-1].player_sum < 14)
        return 0.95 * p_hit, 0.95 * (1 - p_hit)

    exact = run(evaluate_game(solution, by_history(f), invalid_score=invalid_score))
    assert exact.complete and exact.width == 0.0
    bounds = outcome_bounds(Rules(), invalid_score)
    worst, best = outcome_range(Rules(), invalid_score)
    for budget in (50, 300, 3000):
        g = run(evaluate_game(solution, by_history(f), invalid_score=invalid_score, budget=budget, batch=64))
        assert g.nodes == budget and not g.complete
        assert g.value_low <= exact.value <= g.value_high
        gaps = [(r, bounds[(*h[-1], is_natural(h))]) for h, r in g.frontier]
        width = math.fsum(r * (b - w) for r, (w, b) in gaps)
        assert g.width == pytest.approx(width, rel=1e-9, abs=1e-15)
        assert g.unexplored_mass == pytest.approx(math.fsum(r for _, r in g.frontier), abs=1e-15)
        assert g.explored_mass == pytest.approx(1.0 - g.unexplored_mass)
        assert g.width <= g.unexplored_mass * (best - worst) + 1e-12
    widths = [run(evaluate_game(solution, by_history(f), budget=b)).width for b in (300, 1000, 3000)]
    assert widths[0] > widths[1] > widths[2]


def test_the_most_decisions_any_play_can_reach():
    assert most_decisions(21, False, 10) == 1.0  # every card busts a hard 21
    assert most_decisions(20, False, 10) == pytest.approx(1 + 1 / 13)  # only an ace keeps it alive, at 21
    assert most_decisions(12, False, 1) == 1.0  # the last allowed answer
    # a deeper allowance can only add decisions, and a soft hand never busts on its next card
    assert most_decisions(12, False, 2) < most_decisions(12, False, 10)
    assert most_decisions(13, True, 2) == 2.0


@pytest.mark.parametrize("budget", [20, 300, 2000, 4000])
def test_the_accuracy_after_a_hit_of_a_partial_tree_bounds_the_whole_trees(solution, budget):
    """A policy that is right on the likeliest histories and wrong deeper down: the accuracy over the
    histories read overstates it, and its bounds hold the whole tree's accuracy (at budgets 2000 and
    4000 only because they count the decisions below each unread history, not just its own)."""
    def f(h):
        right = len(h) <= 2  # optimal at the first decision and the one after a hit, wrong later
        p_hit = float((solution.best_action(h[-1], is_natural(h)) == HIT) == right)
        return p_hit, 1.0 - p_hit

    exact = run(evaluate_game(solution, by_history(f), max_turns=4))
    assert exact.complete and exact.after_hit_accuracy_low == exact.after_hit_accuracy == exact.after_hit_accuracy_high
    g = run(evaluate_game(solution, by_history(f), max_turns=4, budget=budget, batch=64))
    assert not g.complete
    assert g.after_hit_accuracy_low <= exact.after_hit_accuracy <= g.after_hit_accuracy_high
    if budget > len(deals()):  # some decisions after a hit were read: the likeliest, where this policy is right
        assert g.after_hit_accuracy > exact.after_hit_accuracy + 0.05


def test_the_search_stops_at_the_target_width_and_checks_the_policy(solution):
    optimal = stationary(lambda s, d, u, n: float(solution.best_action((s, d, u), n) == HIT))
    g = run(evaluate_game(solution, optimal, target_width=0.05, batch=32))
    assert g.width <= 0.05 and not g.complete and g.nodes < 5000
    assert g.value_low <= solution.value <= g.value_high
    with pytest.raises(ValueError, match="at most 1"):
        run(evaluate_game(solution, by_history(lambda h: (0.7, 0.7))))
    with pytest.raises(ValueError, match="answered 0 of"):
        run(evaluate_game(solution, _answers_nothing))
    with pytest.raises(ValueError, match="at least 1"):
        run(evaluate_game(solution, optimal, budget=0))


async def _answers_nothing(histories):
    return []


def test_the_grid_carries_the_whole_game(solution):
    g = run(exact_grid(Player(ThresholdBot(12), None, solution)))
    assert g["whole_game"]["complete"] and abs(g["whole_game"]["value"] - g["value"]) < 1e-9


# --------------------------------------------------------------------------- the model's prompts


class Recorder:
    """Hits twice then sticks, keeping every prompt it was shown."""

    name = "recorder"

    def __init__(self):
        self.turns = []

    def generation_params(self):
        return {"policy": self.name}

    async def respond(self, turn):
        self.turns.append((turn.observation, list(turn.prompt_ids)))  # the trajectory grows after
        return Reply(text=tool_call_text(HIT if len(self.turns) <= 2 else STICK))

    async def aclose(self):
        pass


def test_a_historys_prompt_is_the_episodes_own(vocab_chat, solution):
    checked = 0
    for seed in range(40):
        bot = Recorder()
        ep = run(play_episode(Table(Rules()), bot, vocab_chat, solution, seed))
        history = ()
        for obs, prompt in bot.turns:
            history = (*history, Observation(*obs))
            assert history_ids(vocab_chat, history) == prompt
            checked += len(history) > 1
        assert ep.failed is False
    assert checked > 20


class GridBot:
    """Plays the stochastic policy of a grid, seeded per turn: its Monte Carlo is the check."""

    name = "grid"

    def __init__(self, p_hit):
        self.p_hit = p_hit

    def generation_params(self):
        return {"policy": self.name}

    async def respond(self, turn):
        o = turn.observation
        h = self.p_hit[(o.player_sum, o.dealer_card, o.usable_ace)]
        return Reply(text=tool_call_text(HIT if random.Random(turn.seed).random() < h else STICK))

    async def aclose(self):
        pass


def _monte_carlo(p_hit, chat, solution, n):
    bot = GridBot(p_hit)

    async def main():
        table = Table(Rules())
        return [await play_episode(table, bot, chat, solution, 10**9 + i) for i in range(n)]

    rewards = [ep.reward for ep in run(main())]
    mean = statistics.fmean(rewards)
    se = statistics.stdev(rewards) / math.sqrt(n)
    return mean, se


def test_the_grids_value_agrees_with_a_monte_carlo_of_a_stochastic_chart(vocab_chat, solution):
    """grid.py's value of a chart that hits with some probability in every cell is the mean reward of
    playing it (the chart's first-decision policy held at every decision)."""
    rng = random.Random(7)
    p_hit = {k: rng.uniform(0.05, 0.95) for k in GRID_STATES}
    g = evaluate_grid(solution, p_hit)
    mean, se = _monte_carlo(p_hit, vocab_chat, solution, 30_000)
    assert abs(mean - g.value) < 3.5 * se, (mean, se, g.value)
    # and the check tells charts apart: the opposite chart's value is far outside that bound
    assert abs(g.value - evaluate_grid(solution, {k: 1.0 - p for k, p in p_hit.items()}).value) > 7 * se


@pytest.mark.embedded
@pytest.mark.slow
def test_the_models_whole_game_reads_its_first_decisions_as_the_probe(embedded, solution, monkeypatch):
    """The probe (the chart's reading of the model), a direct scoring of the two calls and the
    whole game's first decisions read the same numbers, on the likeliest deals."""
    player = Player(embedded, embedded.chat, solution)
    fresh = run(evaluate_game(solution, node_policy(player), budget=24, batch=24))
    assert fresh.max_depth == 0 and len(fresh.roots) == 24
    k = (16, 10, False)
    probe = run(probe_policy(player, states=[*fresh.roots, k]))
    assert set(probe.p_hit) == {*fresh.roots, k} and 0.0 < probe.p_hit[k] < 1.0
    for obs, (p_hit, p_stick) in fresh.roots.items():
        assert p_hit / (p_hit + p_stick) == pytest.approx(probe.p_hit[obs], abs=1e-6)
        assert p_hit + p_stick == pytest.approx(probe.p_calls[obs], rel=1e-6)
    # a direct scoring of the two calls reads the same bits, whatever the policy's cache held before
    # (only the sums' rounding differs)
    prompt = embedded.chat.prompt_ids(opening_messages(Observation(*k)))
    calls = [embedded.chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]
    (hit, stick), = run(embedded.answer_logprobs_many([(prompt, calls)], None, same_kernels=False))
    assert probe.p_hit[k] == pytest.approx(1 / (1 + math.exp(sum(stick) - sum(hit))), abs=1e-12)
    # the whole game takes the first decisions the probe read from it, scoring none of them again
    scored = []
    score = embedded.answer_logprobs_many

    async def counted(items, *args, **kwargs):
        scored.extend(items)
        return await score(items, *args, **kwargs)

    monkeypatch.setattr(embedded, "answer_logprobs_many", counted)
    g = run(exact_game(player, budget=len(fresh.roots), target_width=0.0, probe=probe))
    assert g["nodes"] == len(fresh.roots) and g["max_depth"] == 0 and not g["complete"] and scored == []
    assert -1.0 <= g["value_low"] <= g["value_high"] <= 1.0 and g["width"] > 0.0
    # and the model's histories after a hit: the likeliest below hitting hard 16 against a 10
    below = run(hit_value(solution, node_policy(player, probe=probe), (Observation(*k),), budget=16, batch=16))
    assert below.nodes == 16 == len(scored) and below.max_depth >= 1
    assert below.after_hit_accuracy is not None and 0.0 <= below.after_hit_accuracy <= 1.0
    assert -1.0 <= below.value_low <= below.value_high <= 1.0


def test_grid_and_evaluate_write_and_print_the_whole_game(tmp_path):
    import json

    from helpers import run_cli

    grid = run_cli("grid", "--policy", "threshold", "--threshold", "12", "--out", str(tmp_path / "g"), cwd=tmp_path)
    assert grid.returncode == 0, grid.stdout + grid.stderr
    game = json.loads((tmp_path / "g" / "grid.json").read_text())["whole_game"]
    exact = policy_outcome(Rules(), lambda s, d, u, n: float(s < 12)).value
    assert game["complete"] and abs(game["value"] - exact) < 1e-9 and game["nodes"] == 5670
    assert "whole game" in grid.stdout and "after a hit" in grid.stdout
    assert 'id="whole-game"' in (tmp_path / "g" / "grid.html").read_text()
    ev = run_cli("evaluate", "--policy", "threshold", "--threshold", "12", "--episodes", "30", "--grid",
                 "--out", str(tmp_path / "e"), cwd=tmp_path)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert abs(metrics["grid"]["whole_game"]["value"] - exact) < 1e-9
    assert "whole game" in ev.stdout and 'id="whole-game"' in (tmp_path / "e" / "report.html").read_text()
    # a tree that is not covered: the accuracy after a hit of those read, and its bounds for all of them
    rand = run_cli("grid", "--policy", "random", "--out", str(tmp_path / "r"), cwd=tmp_path, env={"COLUMNS": "400"})
    assert rand.returncode == 0, rand.stdout + rand.stderr
    game = json.loads((tmp_path / "r" / "grid.json").read_text())["whole_game"]
    assert not game["complete"] and game["after_hit_accuracy"] == pytest.approx(0.5)
    assert 0.49 < game["after_hit_accuracy_low"] < 0.5 < game["after_hit_accuracy_high"] < 0.51
    assert "of those read (all of them: " in rand.stdout and "all of them: " in (tmp_path / "r" / "grid.html").read_text()


def test_the_trainers_chart_carries_the_whole_game_unless_told_not_to(solution):
    from blackjack_rl.config import Settings
    from blackjack_rl.train.metrics import grid_metrics

    player = Player(ThresholdBot(12), None, solution)
    exact = policy_outcome(Rules(), lambda s, d, u, n: float(s < 12)).value
    row = grid_metrics(player, Settings())  # the trainer's small budget: an interval
    assert row["game_value_low"] < exact < row["game_value_high"]
    row = grid_metrics(player, Settings(train={"game_budget": 10_000}))  # enough for this tree
    assert abs(row["game_value"] - exact) < 1e-9 and row["game_value_low"] == row["game_value_high"]
    assert 0.0 < row["after_hit_accuracy"] < 1.0 and abs(row["grid_value"] - exact) < 1e-9
    off = grid_metrics(player, Settings(train={"game_budget": 0}))
    assert off["game_value"] is None and off["after_hit_accuracy"] is None and off["grid_value"] == row["grid_value"]


def test_a_rare_call_still_reads_some_decisions_after_a_hit(solution):
    """Calls at one in ten thousand meet any width with the first decisions alone; min_nodes
    still reads the likeliest histories after a hit, in one batch of exactly that many."""
    sizes = []

    async def rare(histories):
        sizes.append(len(histories))
        return [(1e-4 * (h[-1].player_sum < 17), 1e-4 * (h[-1].player_sum >= 17)) for h in histories]

    g = run(evaluate_game(solution, rare, target_width=0.01, min_nodes=len(deals()) + 40, batch=len(deals())))
    assert sizes == [len(deals()), 40] and g.nodes == len(deals()) + 40
    assert g.after_hit_accuracy is not None and g.width <= 0.01
    assert run(evaluate_game(solution, rare, target_width=0.01, batch=len(deals()))).after_hit_accuracy is None
