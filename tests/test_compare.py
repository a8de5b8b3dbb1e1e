"""Runs compared deal by deal: the pairing logic, and the real command on two bots with a known gap."""

import json
from functools import partial

import pytest
from helpers import run_cli

from blackjack_rl.measure.compare import Run, check_comparable, compare_pair, pair_by_seed, paired_difference
from blackjack_rl.game.table import Rules
from blackjack_rl.game.solver import policy_outcome, solve
from records_factory import metrics as _metrics
from records_factory import sample_row

run = partial(run_cli, check=True)


def test_paired_difference_is_the_mean_of_per_pair_differences():
    p = paired_difference([0.0, 1.0, -1.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert p.mean == pytest.approx(0.25) and p.n == 4
    assert (p.b_better, p.a_better, p.ties) == (2, 1, 1)
    # sd of the differences [1, 0, 1, -1] is sqrt(11/12); se = sd / 2
    assert p.stderr == pytest.approx((11 / 12) ** 0.5 / 2)
    assert p.ci95_low is None and p.ci95_high is None and not p.significant  # 4 pairs: too few for an interval
    wide = paired_difference([0.0, 1.0, -1.0, 1.0] * 10, [1.0, 1.0, 0.0, 0.0] * 10)
    assert wide.ci95_low < 0 < wide.ci95_high and not wide.significant
    assert paired_difference([0.0] * 50, [1.0] * 50).significant
    with pytest.raises(ValueError, match="equal length"):
        paired_difference([1.0], [])


def test_pairing_uses_shared_seeds_and_drops_failed_episodes():
    a = [sample_row(s, "finished", reward=1.0) for s in (1, 2, 3, 4)]
    b = [sample_row(s, "failed" if s == 3 else "finished", reward=0.0) for s in (2, 3, 4, 5, 6)]
    pairing = pair_by_seed(a, b)
    assert pairing.seeds == [2, 4] and (pairing.only_a, pairing.only_b, pairing.failed) == (1, 2, 1)
    c = compare_pair(Run("a", _metrics(), a), Run("b", _metrics(), b))
    assert c.differences["outcome"].mean == -1.0 and c.pairs == 2


def test_pairing_removes_the_luck_both_runs_share():
    """Same deals, same outcome on most of them: the paired interval is far tighter than two independent ones."""
    import random

    from blackjack_rl.measure.evaluation import mean_ci

    rng = random.Random(0)
    luck = [rng.choice([-1.0, 0.0, 1.0]) for _ in range(2000)]
    a = [sample_row(i, reward=x) for i, x in enumerate(luck)]
    b = [sample_row(i, reward=x + (1.0 if i % 20 == 0 and x < 1 else 0.0)) for i, x in enumerate(luck)]
    p = compare_pair(Run("a", _metrics(), a), Run("b", _metrics(), b)).differences["outcome"]
    assert p.mean == pytest.approx(sum(r.reward for r in b) / 2000 - sum(luck) / 2000) and p.significant
    se_a, se_b = mean_ci([r.reward for r in a]).stderr, mean_ci([r.reward for r in b]).stderr
    assert p.stderr < (se_a**2 + se_b**2) ** 0.5 / 5


def test_runs_on_different_rules_are_refused():
    a = Run("a", _metrics(rules=Rules(natural=False)), [])
    b = Run("b", _metrics(rules=Rules(natural=True)), [])
    with pytest.raises(ValueError, match="same --natural/--sab"):
        check_comparable([a, b])
    with pytest.raises(ValueError, match="at least two runs"):
        check_comparable([a])


@pytest.fixture(scope="module")
def bot_runs(tmp_path_factory):
    """The optimal bot and the hit-below-17 bot on the same 3000 fixed deals."""
    root = tmp_path_factory.mktemp("runs")
    run("evaluate", "--policy", "optimal", "--episodes", "3000", "--out", str(root / "optimal"), "--quiet")
    run("evaluate", "--policy", "threshold", "--threshold", "17", "--episodes", "3000", "--out",
        str(root / "threshold17"), "--quiet")
    return root


def test_compare_finds_the_known_gap_between_two_bots(bot_runs):
    rules = Rules()
    exact = policy_outcome(rules, lambda s, d, u, n: float(s < 17)).value - solve(rules).value  # about -0.0327
    out = bot_runs / "cmp"
    proc = run("compare", str(bot_runs / "optimal"), str(bot_runs / "threshold17"), "--out", str(out))
    assert "threshold17 is worse" in proc.stdout
    data = json.loads((out / "compare.json").read_text())
    assert data["baseline"] == "optimal"
    diff = data["comparisons"][0]["differences"]
    score, expected = diff["outcome"], diff["expected"]
    # the game outcomes, paired by deal: the sign is right and the interval holds the exact gap
    assert score["n"] == 3000 and score["significant"] and score["ci95_high"] < 0
    assert score["ci95_low"] <= exact <= score["ci95_high"]
    # without the luck of later cards the interval is several times narrower and still holds it
    assert expected["ci95_low"] <= exact <= expected["ci95_high"] < 0
    assert expected["ci95_high"] - expected["ci95_low"] < (score["ci95_high"] - score["ci95_low"]) / 4
    # the first decision is taken in the same state by both bots, so it pairs exactly
    assert diff["first_correct"]["a_better"] > 0 and diff["first_correct"]["b_better"] == 0
    states = data["comparisons"][0]["state_differences"]
    hard16_vs_2 = next(s for s in states if s["state"] == [16, 2, 0])  # optimal sticks, the bot hits
    assert hard16_vs_2["hit_a"] == 0.0 and hard16_vs_2["hit_b"] == 1.0
    html = (out / "compare.html").read_text()
    assert "threshold17 against optimal" in html and 'src="http' not in html


def test_compare_explains_what_is_missing(bot_runs, tmp_path):
    proc = run("compare", str(bot_runs / "optimal"), str(tmp_path), check=False)
    assert proc.returncode == 2 and "not an evaluation run" in " ".join(proc.stderr.split())
    (tmp_path / "metrics.json").write_text((bot_runs / "optimal" / "metrics.json").read_text())
    proc = run("compare", str(bot_runs / "optimal"), str(tmp_path), check=False)
    assert proc.returncode == 2 and "without --no-samples" in " ".join(proc.stderr.split())


def test_compare_has_help():
    out = run("compare", "--help").stdout
    assert "usage:" in out and "baseline" in out


# -- what is compared: play alone, never the training score's bonus or mode ----------------------

def test_compare_leaves_out_the_format_bonus_and_the_scoring_mode(bot_runs):
    """Threshold-17 scored by outcome against optimal scored `expected` with a format bonus of 0.5:
    the game-reward gap is the exact +0.0327 of play, not +0.53 with the bonus mixed in."""
    rules = Rules()
    exact = solve(rules).value - policy_outcome(rules, lambda s, d, u, n: float(s < 17)).value  # about +0.0327
    bonus = bot_runs / "optimal-bonus"
    run("evaluate", "--policy", "optimal", "--episodes", "3000", "--scoring", "expected", "--format-bonus", "0.5",
        "--out", str(bonus), "--quiet")
    metrics = json.loads((bonus / "metrics.json").read_text())
    assert (metrics["scoring"], metrics["format_bonus"]) == ("expected", 0.5)  # recorded with the run
    out = bot_runs / "cmp-bonus"
    proc = run("compare", str(bot_runs / "threshold17"), str(bonus), "--out", str(out))
    data = json.loads((out / "compare.json").read_text())["comparisons"][0]
    reward, expected = data["differences"]["outcome"], data["differences"]["expected"]
    for d in (reward, expected):
        assert d["ci95_low"] <= exact <= d["ci95_high"] < 0.2
    assert abs(reward["mean_b"] - metrics["mean_reward"]["mean"]) < 1e-9  # the run's own game reward, no bonus
    assert "score" not in data["differences"]
    said = " ".join(proc.stdout.split())
    assert "no format bonus" in said and "optimal-bonus scored expected with format bonus 0.5" in said
    assert any("format bonus 0.5" in note for note in data["notes"])


# -- intervals stay inside what is possible, or say "too few" ---------------------------------

def test_a_paired_interval_stays_within_the_possible_difference():
    """29 of 30 deals won by B only: a normal interval would reach past +100 points."""
    a = [sample_row(i, outcome="loss", reward=-1.0) for i in range(30)]
    b = [sample_row(i, outcome="win" if i else "loss", reward=1.0 if i else -1.0) for i in range(30)]
    c = compare_pair(Run("a", _metrics(invalid_score=-1.0), a), Run("b", _metrics(invalid_score=-1.0), b))
    win, reward = c.differences["win"], c.differences["outcome"]
    assert win.mean + 1.96 * win.stderr > 1 and win.ci95_high <= 1.0  # cut at the bound
    assert reward.mean + 1.96 * reward.stderr > 2 and reward.ci95_high <= 2.0


def test_too_few_pairs_give_no_interval_and_say_so():
    from blackjack_rl.measure.compare import QUANTITIES, verdict

    a = [sample_row(i, outcome="loss", reward=-1.0) for i in range(5)]
    b = [sample_row(i, outcome="win", reward=1.0) for i in range(5)]
    c = compare_pair(Run("a", _metrics(), a), Run("b", _metrics(), b))
    p = c.differences["outcome"]
    assert p.ci95_low is None and not p.significant
    assert "too few to tell" in verdict(p, next(q for q in QUANTITIES if q.key == "outcome"), "a", "b")
    assert any("too few" in note for note in c.notes)


def test_evaluation_intervals_respect_the_bounds_or_say_too_few(vocab_chat, solution):
    """Mostly invalid answers put the normal interval of the mean reward below -1; two
    decisions are too few for an interval of the regret."""
    import asyncio

    from blackjack_rl.measure.evaluation import compute_metrics
    from blackjack_rl.rollout.runner import run_evaluation
    from blackjack_rl.rollout.players import Player
    from blackjack_rl.policies.base import Reply
    from blackjack_rl.policies.bots import OptimalBot

    class RarelyValid(OptimalBot):
        """Plays (optimally) only its first two hands of 20 or more; answers nonsense otherwise."""

        valid = 0

        async def respond(self, turn):
            if turn.observation[0] >= 20 and self.valid < 2:
                self.valid += 1
                return await super().respond(turn)
            return Reply(text="no idea")

    def metrics(policy, n):
        player = Player(policy, vocab_chat, solution)
        return compute_metrics(asyncio.run(run_evaluation(player, n, 1)), player)  # one at a time: in seed order

    m = metrics(RarelyValid(solution), 60)
    mr = m.mean_reward
    assert mr.mean - 1.96 * mr.stderr < -1 <= mr.ci95_low < mr.ci95_high <= 1
    assert -1 <= m.mean_expected_score.ci95_low
    assert m.mean_regret.too_few and m.mean_regret.ci95_low is None  # two valid decisions
    few = metrics(OptimalBot(solution), 2)
    assert few.mean_regret.n < 30 and few.mean_regret.too_few and few.mean_regret.ci95_low is None
    assert few.mean_reward.too_few and few.mean_reward.ci95_high is None


def test_a_regret_interval_never_goes_below_zero():
    from blackjack_rl.measure.evaluation import mean_ci

    regrets = [0.0] * 39 + [0.5]  # one costly mistake in 40 decisions
    r = mean_ci(regrets, (0.0, 2.5))
    assert r.mean - 1.96 * r.stderr < 0 and r.ci95_low == 0.0 < r.ci95_high


@pytest.mark.parametrize("metrics", ["{\"episodes\": 3", "[1, 2]"], ids=["truncated", "not an object"])
def test_a_damaged_metrics_file_is_one_line(bot_runs, tmp_path, metrics):
    (tmp_path / "metrics.json").write_text(metrics)
    (tmp_path / "samples.jsonl").write_text((bot_runs / "optimal" / "samples.jsonl").read_text())
    proc = run("compare", str(bot_runs / "optimal"), str(tmp_path), "--out", str(tmp_path / "cmp"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "metrics.json" in proc.stderr
