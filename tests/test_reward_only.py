"""Reward-only credit (`--credit step-rollouts`): the table's common random numbers, the rollout
estimate of Q^pi, the options the mode refuses, and that no solver output reaches training."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import textwrap

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.game.table import HIT, STICK, Observation, Rules, Table
from blackjack_rl.rollout.estimates import CallMemo, estimate_q
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot, ThresholdBot
from helpers import ScoringStub, cli_env, run_cli


def test_a_resumed_hit_and_stick_see_the_same_cards_in_the_same_roles():
    """After a stick the dealer draws from the dealer's stream, never the card a hit would have had."""
    table = Table()
    holes = set()
    for k in range(200):
        key = [7, 0, k]
        table.resume([10, 2], 6, key)
        table.step(STICK)
        stuck = table.dealer_hand
        table.resume([10, 2], 6, key)
        hit = table.step(HIT)
        drawn = table.player_hand[2]
        if not hit.terminated:
            table.step(STICK)
            assert table.dealer_hand == stuck  # the same hole card and draws
        # the dealer's hand does not start with the player's card: the streams are apart
        holes.add(stuck[1])
        table.resume([10, 2], 6, key)
        assert table.step(HIT).observation.player_sum - 12 == drawn or drawn + 12 > 21
    assert len(holes) == 10  # fresh hidden cards per rollout


@pytest.mark.parametrize("rules", [Rules(), Rules(natural=True), Rules(sab=True)], ids=["default", "natural", "sab"])
def test_a_hit_path_is_every_replay_of_its_rollout(rules):
    """`Table.hit_path` plays a rollout's stick after 0, 1, 2, ... hits in one pass; each must be
    what resuming the same key, hitting that many times and sticking gives (cards and rewards),
    naturals and soft hands included."""
    table, reference = Table(rules), Table(rules)
    rng = random.Random(11)
    starts = [[1, 10], [10, 1], [1, 6], [1, 1], [10, 6], [2, 3], [9, 2], [10, 10], [1, 5, 5]]
    seen_busts, longest = 0, 0
    for i in range(1500):
        hand, up, key = starts[i % len(starts)], rng.randint(1, 10), [rng.getrandbits(40), i % 3, i]
        hands, rewards, busts = table.hit_path(hand, up, key, 12)
        want_hands, want_rewards = [], []
        for hits in range(13):
            reference.resume(hand, up, key)
            for _ in range(hits):
                step = reference.step(HIT)
            if hits and step.terminated:
                break
            if hits:
                want_hands.append(step.observation)
            want_rewards.append(reference.step(STICK).reward)
        assert (hands, rewards) == (want_hands, want_rewards), (hand, up, key)
        assert busts == (len(want_rewards) < 13)
        seen_busts += busts
        longest = max(longest, len(hands))
    assert seen_busts > 1000 and longest >= 4  # paths of every length were compared


def test_the_tables_quick_action_check_answers_as_gymnasiums(monkeypatch):
    """A table's env answers a plain int action without Gymnasium's NumPy check (the rollouts'
    inner loop) and every other value as Gymnasium does."""
    import numpy as np
    from gymnasium.spaces import Discrete

    space, reference = Table()._env.action_space, Discrete(2)
    for x in [0, 1, 2, -1, True, False, 1.0, np.int64(1), np.int64(2), np.int8(0), np.array(1), "1", None]:
        assert space.contains(x) == reference.contains(x), repr(x)
    calls = []
    check = Discrete.contains
    monkeypatch.setattr(Discrete, "contains", lambda self, x: (calls.append(x), check(self, x))[1])
    table = Table()
    table.hit_path([10, 2], 6, [1, 2, 3], 12)
    table.reset(5)
    table.step(HIT)
    assert calls == []  # every action the game loop gives is a plain int
    assert table._env.action_space.contains(np.int64(1)) and calls == [np.int64(1)]


@pytest.mark.parametrize("bot", ["optimal", "threshold"])
def test_rollouts_estimate_the_continuing_policys_q(solution, vocab_chat, bot):
    """With the optimal bot continuing, the estimates converge on Q*; with the threshold bot, on
    Q^pi of that bot (computed here by its own recursion), within 4.5 standard errors."""
    policy = OptimalBot(solution) if bot == "optimal" else ThresholdBot(17)
    player = Player(policy, vocab_chat, solution)

    def q_pi(s: int, d: int, u: bool) -> float:  # the bot's value after a hit from (s, d, u)
        from blackjack_rl.game.solver import CARD_PROBS, after_hit

        total = 0.0
        for card, p in CARD_PROBS:
            s2, u2 = after_hit(s, u, card)
            if s2 > 21:
                total -= p
            elif policy.hit_probability(Observation(s2, d, u2), False) > 0.5:
                total += p * q_pi(s2, d, u2)
            else:
                total += p * solution.q_values((s2, d, u2))[0]
        return total

    k = 6000
    for hand, obs in [([10, 2], Observation(12, 6, False)), ([1, 6], Observation(17, 9, True)),
                      ([5, 6], Observation(11, 10, False))]:
        est = asyncio.run(estimate_q(player, CallMemo(), [1], hand, obs, 99, 0, k))
        q_stick = solution.q_values(obs)[0]
        assert abs(est.q_stick - q_stick) < 4.5 / math.sqrt(k)
        assert abs(est.q_hit - q_pi(*obs)) < 4.5 * 1.2 / math.sqrt(k)
        # the same key gives the same estimate; another deal other cards
        again = asyncio.run(estimate_q(player, CallMemo(), [1], hand, obs, 99, 0, k))
        assert again.q == est.q
        assert asyncio.run(estimate_q(player, CallMemo(), [1], hand, obs, 100, 0, 64)).q != \
            asyncio.run(estimate_q(player, CallMemo(), [1], hand, obs, 99, 0, 64)).q


def test_common_random_numbers_cut_the_noise_of_the_difference(solution, vocab_chat):
    """Aligned streams against independent ones for the two actions: the hit-stick difference
    varies far less per rollout (counted on fixed keys, not timed)."""
    from blackjack_rl.rollout.estimates import _card_path

    table = Table()
    aligned, independent = [], []
    for k in range(3000):
        a = _card_path(table, [10, 6], 10, [1, 0, k])
        b = _card_path(table, [10, 6], 10, [2, 0, k])
        hit_a = -1.0 if a.busts and not a.hands else a.stick_rewards[1]  # hit once, then stick
        aligned.append(hit_a - a.stick_rewards[0])
        independent.append(hit_a - b.stick_rewards[0])

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    assert var(aligned) < 0.85 * var(independent)  # 0.78 measured on these keys


@pytest.mark.parametrize("flags, message", [
    ({"starts": "chart"}, "--starts chart chooses or weighs states by the solver"),
    ({"continue_with": "best"}, "--continue-with best chooses"),
])
def test_the_reward_only_mode_refuses_what_reads_the_solver(flags, message):
    with pytest.raises(ValueError, match=message):
        GroupConfig(credit="step-rollouts", **flags)
    GroupConfig(credit="step-rollouts", starts="uniform", group_size=0, rollouts=8)
    with pytest.raises(ValueError, match="--rollouts sets the rollouts of --credit step-rollouts"):
        GroupConfig(credit="step-counterfactual", rollouts=8)


@pytest.mark.embedded
def test_rollout_groups_carry_their_estimate_and_credit_it(embedded, vocab_chat, solution):
    """A step-rollouts group of the embedded model: its decision credit is p(a) * (Q^(a) - V_p)
    with the estimate it records, and Q* is kept beside it, for the record only."""
    from blackjack_rl.rollout.stepgroups import play_step_groups
    from blackjack_rl.rollout.episodes import EpisodeSettings

    player = Player(embedded, vocab_chat, solution, EpisodeSettings(max_new_tokens=48))
    config = GroupConfig(credit="step-rollouts", group_size=0, rollouts=4, starts="uniform")
    memo = CallMemo()
    deal = asyncio.run(play_step_groups(player, 11, config, memo=memo))
    group = deal.groups[0].group
    first = group.episodes[0]
    assert first.rollouts == 4 and set(first.q_estimate) == {"stick", "hit", "se_gap"}
    assert first.q_estimate != first.q  # an estimate from 4 rollouts, not the solver's value
    by_action = {r.action: i for i, r in enumerate(group.episodes)}
    assert group.scores[by_action["hit"]] == first.q_estimate["hit"]
    assert group.scores[by_action["stick"]] == first.q_estimate["stick"]
    assert memo.scored >= 1  # the continuation asked the model at the histories after a hit


LEAK_SCRIPT = textwrap.dedent("""
    import random, sys
    import blackjack_rl.game.solver as solver
    real = solver.solve
    if sys.argv[1] == "random":
        def solve(rules=None):
            s = real(rules)
            rng = random.Random(0)
            return solver.Solution(s.rules, {k: (rng.uniform(-1, 1), rng.uniform(-1, 1)) for k in s.q}, s.start)
        solver.solve = solve
    from blackjack_rl.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("credit", [[], ["--forced-weight", "greedy", "--format-credit", "likelihood",
                                           "--format-weight", "0.25", "--skip-certain", "1e-3"]],
                         ids=["all-action", "greedy"])
def test_no_solver_output_reaches_reward_only_training(tiny_model_dir, tmp_path, credit):
    """The leak test: three steps with the solver replaced by a random table train exactly the
    same losses and adapter bytes as with the real one (with the all-action credit, and with the
    reward-only recipe's greedy credit and format credit)."""
    pytest.importorskip("torch")
    runs = {}
    for which in ("real", "random"):
        out = tmp_path / which
        args = ["train", "--model-path", str(tiny_model_dir), "--steps", "3", "--deals-per-step", "3",
                "--credit", "step-rollouts", "--group-size", "0", "--rollouts", "4", "--starts", "uniform",
                "--balance-actions", "--scale-decisions", *credit,
                "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "0", "--save-every", "3", "--lora",
                "--threads", "1", "--seed", "3", "--out", str(out)]
        proc = subprocess.run([sys.executable, "-c", LEAK_SCRIPT, which, *args], env=cli_env(), cwd=tmp_path,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        runs[which] = ([r["loss"] for r in rows if r["kind"] == "step"],
                       (out / "checkpoints" / "step_0003" / "adapter_model.safetensors").read_bytes())
    assert len(runs["real"][0]) == 3
    assert runs["real"][0] == runs["random"][0]
    assert runs["real"][1] == runs["random"][1]


class _Recorder(ScoringStub):
    """A policy that scores every call alike and records the prompts it was asked at."""

    name = "recorder"

    def __init__(self, p_call: float = 0.4) -> None:
        self.prompts: list[tuple[int, ...]] = []
        self.p_call = p_call

    async def answer_logprobs_many(self, items, temperature=None, same_kernels=True):
        self.prompts += [tuple(p) for p, _ in items]
        return [[[math.log(self.p_call)] + [0.0] * (len(a) - 1) for a in answers] for _, answers in items]


@pytest.mark.parametrize("continuation", ["history", "chart"])
def test_the_continuation_asks_the_policy_where_it_says(solution, vocab_chat, continuation):
    """history: at the game's own prompt after each hit (the decision's prompt, the hit call, the
    new hand); chart: at the new hand's opening prompt. Each prompt is scored once per memo, and
    P(invalid) = 0.2 here counts as a forfeit in the estimate."""
    from blackjack_rl.rollout.episodes import opening_messages

    policy = _Recorder()
    player = Player(policy, vocab_chat, solution)
    obs = Observation(8, 10, False)
    prompt = vocab_chat.prompt_ids(opening_messages(obs))
    memo = CallMemo()
    est = asyncio.run(estimate_q(player, memo, prompt, [5, 3], obs, 5, 0, 32, continuation))
    assert policy.prompts and len(policy.prompts) == len(set(policy.prompts)) == memo.scored
    openings = {tuple(vocab_chat.prompt_ids(opening_messages(Observation(s, 10, u)))) for s in range(4, 22)
                for u in (False, True) if not u or s >= 12}
    for p in policy.prompts:
        if continuation == "chart":
            assert p in openings
        else:
            assert p[: len(prompt)] == tuple(prompt) and len(p) > len(prompt)
    again = asyncio.run(estimate_q(player, memo, prompt, [5, 3], obs, 5, 0, 32, continuation))
    assert again.q == est.q and memo.scored == len(policy.prompts)  # all from the memo
    # a policy that (almost) never writes a call forfeits after every hit: its mass is not renormalised
    player = Player(_Recorder(1e-12), vocab_chat, solution)
    assert asyncio.run(estimate_q(player, CallMemo(), prompt, [5, 3], obs, 5, 0, 32, continuation)).q_hit == \
        pytest.approx(-1.0, abs=1e-9)


def test_reward_only_balancing_reads_the_estimate_not_the_solver(solution):
    """--balance-actions in step-rollouts weighs decisions by the action their estimate prefers."""
    from blackjack_rl.contract.records import ScoredDataGroup, StepRecord
    from blackjack_rl.train.grpo import action_balance

    def group(optimal: str, estimate: dict | None) -> ScoredDataGroup:
        record = StepRecord(seed=1, decision=0, index=0, state=[12, 2, 0], natural=False, action="hit",
                            optimal=optimal, q={"stick": 0.0, "hit": 0.0}, invalid_reason=None, score=0.0,
                            forced=True, q_estimate=estimate)
        return ScoredDataGroup(tokens=[[1]], masks=[[1]], inference_logprobs=[[0.0]], scores=[0.0], messages=[],
                               generation_params={"group_by": "step"}, episodes=[record])

    hit_better, stick_better = {"hit": 0.1, "stick": -0.2}, {"hit": -0.5, "stick": 0.0}
    # the solver says hit for all four; the estimates split them 3 to 1
    weights = action_balance([group("hit", hit_better)] * 3 + [group("hit", stick_better)])
    assert weights == [2 / 3] * 3 + [2.0]
    assert action_balance([group("hit", None)] * 3 + [group("stick", None)]) == [2 / 3] * 3 + [2.0]


def _snapshot_runner(solution, vocab_chat, refresh: int, policy: _Recorder):
    from blackjack_rl.rollout.runner import DealRunner

    config = GroupConfig(credit="step-rollouts", group_size=0, rollouts=16, starts="uniform", decisions="first",
                         rollout_continuation="chart", rollout_refresh=refresh)
    return DealRunner(Player(policy, vocab_chat, solution), config)


def _estimates(runner, seeds) -> list[dict]:
    deals = asyncio.run(runner.play_all(seeds))
    return [r.group.episodes[0].q_estimate for d in deals for r in d.groups if r.group is not None]


def test_a_snapshot_continuation_holds_for_its_steps_then_moves_on(solution, vocab_chat):
    """--rollout-refresh 3: the continuation is the policy as scored at steps 1 and 4; steps 2 and
    3 value the same deals exactly as step 1 did although the policy changed, and step 4 as a
    fresh runner of the new policy does. All 280 chart prompts are scored at each snapshot."""
    seeds = [11, 12, 13, 14]
    policy = _Recorder(0.3)
    runner = _snapshot_runner(solution, vocab_chat, 3, policy)
    first = _estimates(runner, seeds)
    assert len(first) == 4 and runner.snapshot is not None and len(runner.snapshot) == 280
    assert runner.continuation_scored == 280  # the snapshot: the estimates needed nothing more
    for p_call in (0.45, 0.6):
        policy.p_call = p_call
        assert _estimates(runner, seeds) == first
    later = _estimates(runner, seeds)  # step 4: a new snapshot of the policy at p_call 0.6
    assert later != first
    assert later == _estimates(_snapshot_runner(solution, vocab_chat, 3, _Recorder(0.6)), seeds)
    # without a snapshot the continuation is the policy of each step
    plain = _snapshot_runner(solution, vocab_chat, 1, _Recorder(0.3))
    assert _estimates(plain, seeds) == first
    plain.player.policy.p_call = 0.45
    assert _estimates(plain, seeds) != first


def test_a_restored_snapshot_continues_as_the_saved_one(solution, vocab_chat):
    """A checkpoint carries the snapshot and its age: a resumed run values its next steps with the
    saved snapshot, not one of the resumed weights, and refreshes when the whole run would."""
    import pickle

    seeds = [21, 22]
    runner = _snapshot_runner(solution, vocab_chat, 2, _Recorder(0.3))
    first = _estimates(runner, seeds)
    state = pickle.loads(pickle.dumps(runner.get_snapshot()))
    resumed = _snapshot_runner(solution, vocab_chat, 2, _Recorder(0.7))
    resumed.set_snapshot(state)
    assert _estimates(resumed, seeds) == first  # step 2: the saved snapshot
    assert _estimates(resumed, seeds) == _estimates(_snapshot_runner(solution, vocab_chat, 2, _Recorder(0.7)), seeds)


def test_a_snapshot_needs_the_chart_continuation():
    with pytest.raises(ValueError, match="--rollout-refresh holds a snapshot of the chart continuation"):
        GroupConfig(credit="step-rollouts", group_size=0, rollout_refresh=5)
    with pytest.raises(ValueError, match="--rollout-refresh holds a snapshot"):
        GroupConfig(credit="step-counterfactual", rollout_refresh=5)


@pytest.mark.slow
def test_a_resumed_run_keeps_its_continuation_snapshot(tiny_model_dir, tmp_path):
    """Resumed after step 1 of a 3-step snapshot, steps 2 and 3 train exactly as in the whole run:
    the snapshot scored with step 0's weights came back from the checkpoint."""
    pytest.importorskip("torch")
    common = ["--model-path", str(tiny_model_dir), "--deals-per-step", "3", "--credit", "step-rollouts",
              "--group-size", "0", "--rollouts", "4", "--starts", "uniform", "--rollout-continuation", "chart",
              "--rollout-refresh", "3", "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "0",
              "--save-every", "1", "--lora", "--threads", "1", "--seed", "4", "--lr", "1e-2", "--steps", "3"]
    whole = run_cli("train", *common, "--out", str(tmp_path / "whole"), cwd=tmp_path, timeout=900)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    resumed = run_cli("train", *common, "--out", str(tmp_path / "resumed"), "--resume",
                      str(tmp_path / "whole" / "checkpoints" / "step_0001"), cwd=tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    def run(name: str) -> tuple[list, bytes]:
        rows = [json.loads(x) for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        return ([(r["step"], r["loss"], r["mean_score"]) for r in rows if r["kind"] == "step" and r["step"] > 1],
                (tmp_path / name / "checkpoints" / "step_0003" / "adapter_model.safetensors").read_bytes())

    assert len(run("whole")[0]) == 2
    assert run("whole") == run("resumed")
    # the tiny model never writes a call, so every snapshot is alike: what shows that the saved
    # one came back is that the resumed steps scored no snapshot, as the whole run's did not
    scored = {name: [r["continuation_scored"] for r in map(json.loads, (tmp_path / name / "train_log.jsonl")
                                                           .read_text().splitlines()) if r["kind"] == "step"]
              for name in ("whole", "resumed")}
    assert scored["whole"] == [280, 0, 0] and scored["resumed"][-2:] == [0, 0]


def test_the_estimates_standard_error_is_the_paired_differences(solution, vocab_chat):
    """se_gap is the standard error of q_hit - q_stick over the k paired rollouts: across
    independent deals' keys its values match the spread of the estimated gaps themselves."""
    player = Player(ThresholdBot(17), vocab_chat, solution)
    obs = Observation(14, 9, False)

    def estimate(deal: int, k: int):
        return asyncio.run(estimate_q(player, CallMemo(), [], [9, 5], obs, deal, 0, k))

    draws = [estimate(deal, 16) for deal in range(400)]
    gaps = [d.q_hit - d.q_stick for d in draws]
    mean = sum(gaps) / len(gaps)
    spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    typical = math.sqrt(sum(d.se_gap ** 2 for d in draws) / len(draws))
    assert typical == pytest.approx(spread, rel=0.15)
    assert estimate(1, 1).se_gap == 0.0


def test_a_gap_within_its_noise_keeps_a_small_scale():
    """Scaled credit divides by max(|gap|, 0.05, 2 se): a decision whose estimated gap is within
    two standard errors of zero is not blown up to full size; a clear one still is."""
    from blackjack_rl.rollout.credit import AnswerCredit, decision_advantages

    calls = [AnswerCredit(True, 1, True), AnswerCredit(True, 0, True)]
    p = {1: 0.5, 0: 0.5}
    clear = decision_advantages(calls, (-0.5, 0.3), p, scale=True, se_gap=0.05)
    assert clear == pytest.approx([0.25, -0.25])  # p(a) (Q(a) - V) / |gap|: as before
    noisy = decision_advantages(calls, (-0.5, -0.44), p, scale=True, se_gap=0.06)
    assert noisy == pytest.approx([0.5 * 0.03 / 0.12, -0.5 * 0.03 / 0.12])
    assert decision_advantages(calls, (-0.5, -0.44), p, scale=True) == pytest.approx([0.25, -0.25])


def test_unweighted_forced_credit_does_not_vanish_where_the_policy_is_sure():
    """--forced-weight none: each forced call gets Q(a) - V_p. Summed over the two calls, the
    gradient on the logit difference is (p_hit^2 + p_stick^2) (Q(hit) - Q(stick)), at least half
    the gap at any policy, where the all-action credit p(a) (Q(a) - V_p) gives p_hit p_stick times
    the gap, nothing at a policy sure of one call."""
    from blackjack_rl.rollout.credit import AnswerCredit, decision_advantages

    calls = [AnswerCredit(True, 1, True), AnswerCredit(True, 0, True)]
    q = (-0.2, 0.3)  # hitting is better by 0.5
    for p_hit in (1e-6, 0.2, 0.5, 0.9):
        p = {1: p_hit, 0: 1 - p_hit}
        weighted = decision_advantages(calls, q, p)
        plain = decision_advantages(calls, q, p, forced_weight="none")

        def on_logit(credits):  # d log p(hit)/dz = p_stick, d log p(stick)/dz = -p_hit
            return credits[0] * p[0] - credits[1] * p[1]

        assert on_logit(weighted) == pytest.approx(p_hit * (1 - p_hit) * 0.5)
        assert on_logit(plain) == pytest.approx((p_hit ** 2 + (1 - p_hit) ** 2) * 0.5)
        assert on_logit(plain) >= 0.25
    with pytest.raises(ValueError, match="--forced-weight weighs the forced calls"):
        GroupConfig(credit="step", forced_weight="none")


def test_greedy_forced_credit_is_the_cross_entropy_toward_the_better_call():
    """--forced-weight greedy: the better call (by the group's Q) gets the gap, the other nothing,
    so the gradient on the logit difference is (1 - p_better) times the gap: full where the policy
    is sure of the worse call, nothing where it is sure of the better one. The other two modes
    push on at a sure right policy (none) or stop at a sure wrong one (policy)."""
    from blackjack_rl.rollout.credit import AnswerCredit, decision_advantages, decision_pull

    calls = [AnswerCredit(True, HIT, True), AnswerCredit(True, STICK, True)]
    for q, better in (((-0.2, 0.3), HIT), ((0.1, -0.6), STICK)):
        gap = abs(q[1] - q[0])
        sign = 1 if better == HIT else -1
        for p_hit in (1e-6, 0.3, 0.7, 1 - 1e-6):
            p = {HIT: p_hit, STICK: 1 - p_hit}
            hit, stick = decision_advantages(calls, q, p, forced_weight="greedy")
            assert (hit, stick) == ((gap, 0.0) if better == HIT else (0.0, gap))
            assert decision_pull(q, p, forced_weight="greedy") == pytest.approx(sign * (1 - p[better]) * gap)
        sure_wrong = {better: 1e-6, 1 - better: 1 - 1e-6}
        sure_right = {better: 1 - 1e-6, 1 - better: 1e-6}
        assert abs(decision_pull(q, sure_wrong, forced_weight="greedy")) == pytest.approx(gap, rel=1e-5)
        assert abs(decision_pull(q, sure_wrong)) < 1e-5  # policy: stuck on the wrong call
        assert abs(decision_pull(q, sure_right, forced_weight="greedy")) < 1e-5
        assert abs(decision_pull(q, sure_right, forced_weight="none")) == pytest.approx(gap, rel=1e-5)
    # scaled by the estimate's noise: a near-tie pulls less than a clear gap, never the other way
    near = decision_advantages(calls, (-0.5, -0.44), {HIT: 0.5, STICK: 0.5}, True, 0.06, "greedy")
    clear = decision_advantages(calls, (-0.5, 0.3), {HIT: 0.5, STICK: 0.5}, True, 0.06, "greedy")
    assert near == pytest.approx([0.5, 0.0]) and clear == pytest.approx([1.0, 0.0])
    assert decision_advantages(calls, (0.2, 0.2), {HIT: 0.5, STICK: 0.5}, forced_weight="greedy") == [0.0, 0.0]


@pytest.mark.slow
def test_the_trainers_fidelity_probe_measures_without_changing_training(tiny_model_dir, tmp_path):
    """--fidelity-every: each probed step logs its credit's scores against A^pi at fixed pairs of
    probe deals, and the run trains exactly the losses and adapter bytes of a run without it."""
    pytest.importorskip("torch")
    common = ["--model-path", str(tiny_model_dir), "--deals-per-step", "3", "--credit", "step-rollouts",
              "--group-size", "0", "--rollouts", "4", "--starts", "uniform", "--rollout-continuation", "chart",
              "--rollout-refresh", "2", "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "0",
              "--save-every", "3", "--lora", "--threads", "1", "--seed", "5", "--lr", "1e-2", "--steps", "3"]
    runs = {}
    for name, extra in (("plain", []), ("probed", ["--fidelity-every", "2", "--fidelity-probes", "3"])):
        proc = run_cli("train", *common, *extra, "--out", str(tmp_path / name), cwd=tmp_path, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [json.loads(x) for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        runs[name] = ([(r["loss"], r["elapsed"] >= 0) for r in rows if r["kind"] == "step"],
                      (tmp_path / name / "checkpoints" / "step_0003" / "adapter_model.safetensors").read_bytes(),
                      rows)
    assert runs["plain"][:2] == runs["probed"][:2]
    probed = [r for r in runs["probed"][2] if r["kind"] == "step" and "fidelity" in r]
    assert [r["step"] for r in probed] == [2]
    row = probed[0]
    assert row["fidelity_of"] == "probe" and row["fidelity_deals"] == 6 and row["fidelity_credit_tokens"] > 0
    scores = row["fidelity"]["scores"]["all"]
    # three pairs of deals, each opening on one state, both calls forced at each: two noise pairs a pair
    assert scores["decisions"] == 12 and scores["noise_pairs"] == 6
    assert row["fidelity_seconds"] > 0 and "fidelity @ step 2" in proc.stdout


def test_fidelity_probes_need_fidelity_every(tmp_path):
    proc = run_cli("train", "--fidelity-probes", "4", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert proc.returncode != 0 and "add --fidelity-every" in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("forced_weight", ["policy", "none", "greedy"])
def test_the_decision_pull_is_the_credits_gradient_on_the_logit_difference(forced_weight):
    """decision_pull = d/dz of sum_a adv_a log p(a | z), p(hit) = sigmoid(z), with the forced
    calls' advantages held fixed: checked by a finite difference at assorted policies and gaps."""
    from blackjack_rl.rollout.credit import AnswerCredit, decision_advantages, decision_pull

    rng = random.Random(7)
    for _ in range(50):
        p_hit = rng.uniform(0.001, 0.999)
        q = (rng.uniform(-1, 1), rng.uniform(-1, 1))
        p_call = {HIT: p_hit, STICK: 1 - p_hit}
        scale, se = rng.random() < 0.5, rng.uniform(0, 0.1)
        hit, stick = decision_advantages([AnswerCredit(True, HIT, True), AnswerCredit(True, STICK, True)], q, p_call,
                                         scale, se, forced_weight)
        z, h = math.log(p_hit / (1 - p_hit)), 1e-6

        def surrogate(z: float) -> float:
            p = 1 / (1 + math.exp(-z))
            return hit * math.log(p) + stick * math.log(1 - p)

        numeric = (surrogate(z + h) - surrogate(z - h)) / (2 * h)
        assert decision_pull(q, p_call, scale, se, forced_weight) == pytest.approx(numeric, rel=1e-4, abs=1e-8)


def test_balancing_by_credit_leaves_no_net_pull_where_counting_does():
    """A batch whose stick-better decisions have clear gaps and whose hit-better ones are near
    ties: equal numbers still pull the shared preference toward sticking; equal pulls do not."""
    from blackjack_rl.config import Settings
    from blackjack_rl.contract.records import ScoredDataGroup, StepRecord
    from blackjack_rl.train.grpo import action_balance, credit_pull

    settings = Settings(groups=GroupConfig(credit="step-rollouts", group_size=0, starts="uniform",
                                           balance_actions=True, balance_by="credit"))

    def group(q_hit: float, q_stick: float, p_hit: float) -> ScoredDataGroup:
        record = StepRecord(seed=1, decision=0, index=0, state=[12, 2, 0], natural=False, action="hit",
                            optimal="hit", q={"stick": 0.0, "hit": 0.0}, invalid_reason=None, score=0.0, forced=True,
                            q_estimate={"hit": q_hit, "stick": q_stick, "se_gap": 0.01},
                            p_call={"hit": p_hit, "stick": 1 - p_hit})
        return ScoredDataGroup(tokens=[[1]], masks=[[1]], inference_logprobs=[[0.0]], scores=[0.0], messages=[],
                               generation_params={"group_by": "step"}, episodes=[record])

    batch = [group(0.05, 0.0, 0.3), group(0.02, 0.0, 0.6), group(-0.8, 0.1, 0.2), group(-0.5, 0.0, 0.4)]
    pulls = [credit_pull(g, settings) for g in batch]
    assert [p > 0 for p in pulls] == [True, True, False, False]
    counted = action_balance(batch)
    assert sum(w * p for w, p in zip(counted, pulls)) < -0.01
    balanced = action_balance(batch, pull=lambda g: credit_pull(g, settings))
    assert sum(w * p for w, p in zip(balanced, pulls)) == pytest.approx(0.0, abs=1e-12)
    # the batch's summed |pull| is kept: only the split between the classes moves
    assert sum(w * abs(p) for w, p in zip(balanced, pulls)) == pytest.approx(sum(map(abs, pulls)))


@pytest.mark.parametrize("flags, message", [
    (["--credit", "step-rollouts", "--group-size", "0", "--starts", "uniform", "--balance-by", "credit"],
     "add --balance-actions"),
    (["--credit", "step-tokens", "--balance-actions", "--balance-by", "credit"], "only counterfactual groups hold"),
])
def test_balancing_by_credit_is_refused_where_it_cannot_act(flags, message, tmp_path):
    proc = run_cli("train", *flags, "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1]
