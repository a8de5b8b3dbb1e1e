"""Advantage fidelity: the scores on known cases, the exact A^pi, and `blackjack-rl fidelity`."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from blackjack_rl.game.solver import CARD_PROBS, GRID_STATES, after_hit
from blackjack_rl.game.table import HIT, STICK
from blackjack_rl.measure.fidelity import exact_truths, fidelity_scores
from blackjack_rl.measure.probe import node_policy
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot, ThresholdBot
from helpers import run_cli


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
    """Groups written by `process --credit step-rollouts` with the embedded model, scored with it."""
    out = tmp_path / "rollouts"
    run_cli("process", "--credit", "step-rollouts", "--group-size", "0", "--rollouts", "4", "--starts", "uniform",
            "--groups", "4", "--seed", "1", "--quiet", "--out", str(out), check=True, cwd=tmp_path, timeout=900)
    run = run_cli("fidelity", str(out / "groups.jsonl"), "--out", str(out), cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "fidelity.json").read_text())
    assert doc["scores"]["all"]["decisions"] >= 8  # both calls of each of at least four decisions
    assert doc["policy"]["policy"] == "embedded"


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
