"""Advantage fidelity: the scores on known cases, the exact A^pi, and `blackjack-rl fidelity`."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from blackjack_rl.game.solver import CARD_PROBS, GRID_STATES, after_hit
from blackjack_rl.contract.protocol import tool_call_text
from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.game.table import HIT, STICK
from blackjack_rl.measure.fidelity import exact_truths, fidelity_scores
from blackjack_rl.measure.probe import node_policy
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot, ThresholdBot
from helpers import ScoringStub, run_cli


def _truths(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(-0.5, 0.5) for _ in range(n)]


def test_the_exact_credit_scores_perfectly():
    truth = _truths(500)
    s = fidelity_scores(truth, truth, list(zip(truth, truth)))
    assert s.sign_weighted == 1.0 and s.sign_clear == 1.0
    assert s.correlation == pytest.approx(1.0) and s.bias == 0.0 and s.noise == 0.0


def test_a_credit_of_random_sign_agrees_half_the_time():
    truth = _truths(20_000)
    rng = random.Random(1)
    credit = [abs(t) * rng.choice((-1, 1)) for t in truth]
    s = fidelity_scores(credit, truth)
    assert s.sign_weighted == pytest.approx(0.5, abs=0.02) and s.sign_clear == pytest.approx(0.5, abs=0.02)
    assert abs(s.correlation) < 0.03


def test_the_noise_estimate_recovers_a_known_added_noise():
    truth = _truths(20_000)
    rng = random.Random(2)
    pairs = [(t + rng.gauss(0, 0.3), t + rng.gauss(0, 0.3)) for t in truth]
    s = fidelity_scores([a for a, _ in pairs], truth, pairs)
    assert s.noise == pytest.approx(0.3, rel=0.03)
    assert s.bias == pytest.approx(0.0, abs=0.01)
    biased = fidelity_scores([t + 0.1 for t in truth], truth)
    assert biased.bias == pytest.approx(0.1) and biased.sign_clear < 1.0


def test_the_optimal_bots_advantages_are_q_star_less_v_star(solution, vocab_chat):
    """For the optimal policy A^pi(h, a) = Q*(s, a) - V*(s) at every first decision (the solver
    has no turn limit: with the env's 10 turns a hard 4 differs by ~3e-11)."""
    player = Player(OptimalBot(solution), vocab_chat, solution)
    histories = [(s,) for s in GRID_STATES]
    truths = asyncio.run(exact_truths(solution, node_policy(player), histories, invalid_score=-1.0, max_turns=50,
                                      budget=200_000, target_width=0.0))
    for (s,) in histories:
        q = solution.q_values(s)
        t = truths[(s,)]
        assert t.q_hit_width == 0.0
        assert t.advantage(HIT) == pytest.approx(q[1] - max(q), abs=1e-12)
        assert t.advantage(STICK) == pytest.approx(q[0] - max(q), abs=1e-12)


def test_a_hit_is_valued_by_the_policy_that_follows_it(solution, vocab_chat):
    """Q^pi(h, hit) for a bot that sticks on 12 or more: one card, then Q*(stick) of the new
    hand, whatever the optimal play there would be (not Q*(hit))."""
    player = Player(ThresholdBot(12), vocab_chat, solution)
    histories = [(s,) for s in GRID_STATES if s.player_sum >= 12]
    truths = asyncio.run(exact_truths(solution, node_policy(player), histories, invalid_score=-1.0, max_turns=10,
                                      budget=200_000, target_width=0.0))
    for (s,) in histories:
        expect = 0.0
        for card, p in CARD_PROBS:
            s2, u2 = after_hit(s.player_sum, s.usable_ace, card)
            expect += p * (-1.0 if s2 > 21 else solution.q_values((s2, s.dealer_card, u2))[0])
        assert truths[(s,)].q_hit == pytest.approx(expect, abs=1e-12)
        assert truths[(s,)].advantage(STICK) == pytest.approx(0.0, abs=1e-12)  # it sticks: A of its action is 0


def test_fidelity_scores_a_process_file_and_expected_scoring_beats_outcomes(tmp_path):
    """Outcome GRPO and expected-value GRPO on the same deals of the random bot: both carry a
    real signal (sign agreement above a coin), and the lower-variance score agrees more."""
    signs = {}
    for scoring in ("outcome", "expected"):
        out = tmp_path / scoring
        run_cli("process", "--policy", "random", "--group-size", "8", "--groups", "150", "--scoring", scoring,
                "--seed", "4", "--quiet", "--out", str(out), check=True, cwd=tmp_path)
        run = run_cli("fidelity", str(out / "groups.jsonl"), "--policy", "random", "--out", str(out), cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        doc = json.loads((out / "fidelity.json").read_text())
        assert doc["scores"]["all"]["decisions"] > 1000 and doc["scores"]["all"]["noise_pairs"] > 100
        signs[scoring] = doc["scores"]["all"]["sign_weighted"]
    assert 0.6 < signs["outcome"] < signs["expected"]


def test_fidelity_errors_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"tokens": 1}\n')
    for args, message in [(["missing.jsonl"], "no such groups file"), (["bad.jsonl"], "bad.jsonl:1: not a group"),
                          (["bad.jsonl", "--max-decisions", "0"], "outside 1..100000")]:
        run = run_cli("fidelity", *args, "--policy", "random", "--out", str(tmp_path), cwd=tmp_path)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.embedded
def test_fidelity_reads_the_credit_of_reward_only_groups(tmp_path):
    """Groups written by `process --credit step-rollouts` with the embedded model, scored with it. The
    continuation is the reward-only recipe's (the chart: 280 opening prompts that share the system
    prompt's cache, where each history prompt is new), at first decisions: those after a hit are placed by
    the history they carry in the test below, with a bot whose trees cost nothing. A small tree budget:
    each history the tree reads is a new prompt for the model, and the width is not what is checked."""
    out = tmp_path / "rollouts"
    run_cli("process", "--credit", "step-rollouts", "--group-size", "0", "--rollouts", "4", "--starts", "uniform",
            "--rollout-continuation", "chart", "--decisions", "first", "--groups", "4", "--seed", "1", "--quiet",
            "--out", str(out), check=True, cwd=tmp_path, timeout=900)
    run = run_cli("fidelity", str(out / "groups.jsonl"), "--tree-budget", "2", "--out", str(out), cwd=tmp_path,
                  timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "fidelity.json").read_text())
    assert doc["scores"]["all"]["decisions"] == 8  # both calls of each of the four decisions
    assert doc["policy"]["policy"] == "embedded" and doc["budget"] == 2 and doc["histories"] == 4
    assert 0.0 < doc["max_q_hit_width"] <= 2.0  # a tree cut short, its interval certified


def test_step_groups_after_a_hit_are_placed_by_the_history_they_carry(tmp_path):
    """Step groups of later decisions carry the states before them, so their credit is scored
    against A^pi at the whole history (a step group scores answers by Q*: for the random bot,
    whose continuation is not optimal, its sign is not always A^pi's)."""
    out = tmp_path / "steps"
    run_cli("process", "--policy", "random", "--credit", "step", "--group-size", "4", "--groups", "200",
            "--seed", "2", "--quiet", "--out", str(out), check=True, cwd=tmp_path)
    rows = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    later = [g["episodes"][0] for g in rows if g["episodes"][0]["decision"] > 0]
    assert later and all(len(r["history"]) == r["decision"] for r in later)
    run = run_cli("fidelity", str(out / "groups.jsonl"), "--policy", "random", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    scores = json.loads((out / "fidelity.json").read_text())["scores"]
    assert scores["after_hit"]["decisions"] > 50
    assert 0.5 < scores["all"]["sign_weighted"] < 1.0


class _SameEverywhere(ScoringStub):
    """A policy that writes each call with the same probability at every prompt: the chart
    continuation's Markov projection of it is the policy itself, so rollouts estimate its A^pi.
    The call's probability sits on its action token, however the call is split into answers."""

    name = "same-everywhere"

    def __init__(self, chat, p_hit: float = 0.5, p_stick: float = 0.4) -> None:
        calls = [chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]
        at = common_prefix_length(calls)
        self.logp = {calls[0][at]: math.log(p_hit), calls[1][at]: math.log(p_stick)}

    async def answer_logprobs_many(self, items, temperature=None, same_kernels=True):
        return [[[self.logp.get(t, 0.0) for t in a] for a in answers] for _, answers in items]


def test_probe_deals_come_in_pairs_that_open_on_one_state(solution, vocab_chat):
    from blackjack_rl.config import GroupConfig
    from blackjack_rl.game.table import Table
    from blackjack_rl.rollout.runner import PROBE_SEED_BASE, probe_seeds
    from blackjack_rl.rollout.stepgroups import chart_start

    player = Player(_SameEverywhere(vocab_chat), vocab_chat, solution)
    for config in (GroupConfig(credit="step-rollouts", group_size=0, starts="uniform"), GroupConfig()):
        seeds = probe_seeds(player, config, 20)
        assert len(seeds) == 40 == len(set(seeds)) and min(seeds) >= PROBE_SEED_BASE
        assert probe_seeds(player, config, 20) == seeds  # fixed deals
        table = Table(solution.rules)

        def opening(seed: int):
            start = chart_start(seed, solution, config.starts) if config.group_by == "step" else None
            return table.reset(seed, start=start)

        assert all(opening(a) == opening(b) for a, b in zip(seeds[::2], seeds[1::2]))
        assert len({opening(s) for s in seeds}) > 5  # not one state over and over


def test_a_probe_scores_the_rollouts_credit_against_the_policys_own_advantage(solution, vocab_chat):
    """The trainer's probe (the same credit as a step, at fixed deals) read against A^pi: rollouts
    of a policy that plays alike at every prompt agree with its exact advantage in sign and size,
    every pair of deals gives a noise pair per action, and the step's deal stream is untouched."""
    from blackjack_rl.config import GroupConfig
    from blackjack_rl.jobs.fidelity import exact_fidelity, samples_of
    from blackjack_rl.rollout.runner import probe_seeds
    from blackjack_rl.train.sources import LocalSource

    config = GroupConfig(credit="step-rollouts", group_size=0, rollouts=64, starts="uniform", decisions="first",
                         rollout_continuation="chart")
    player = Player(_SameEverywhere(vocab_chat), vocab_chat, solution)
    source = LocalSource(player, config, deals_per_step=4, seed=0)
    stream = source.seeds.get_state()
    groups = source.probe(probe_seeds(player, config, 12))
    fidelity = asyncio.run(exact_fidelity(samples_of(groups, player, True), player, budget=200,
                                          target_width=0.01))
    scores = fidelity.scores["all"]
    assert scores.decisions == 48 and scores.noise_pairs == 24
    assert scores.sign_clear >= 0.85 and scores.correlation >= 0.95
    # A^pi counts the 10% of answers that are no call as forfeits (-1); the credit's baseline is
    # the value over the two calls alone, so it is lower by 0.1 (V_calls + 1): a bias the scores show
    truths = asyncio.run(exact_truths(solution, node_policy(player), [s.history for s in samples_of(groups, player, True)],
                                      invalid_score=-1.0, max_turns=player.settings.max_turns,
                                      budget=200, target_width=0.01))
    expected = [-0.1 * ((0.5 * t.q_hit + 0.4 * t.q_stick) / 0.9 + 1.0) for t in truths.values()]
    assert scores.bias == pytest.approx(sum(expected) / len(expected), abs=0.02)
    assert scores.bias < -0.03
    assert source.seeds.get_state() == stream
