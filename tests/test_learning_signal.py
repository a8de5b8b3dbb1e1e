"""The learning signal: per-token credit, counterfactual step groups and the exact strategy chart."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.credit import (
    AnswerCredit, action_char_span, action_token_indices, decision_advantages, hit_share,
)
from blackjack_rl.rollout.episodes import EpisodeSettings, opening_messages
from blackjack_rl.game.table import Observation, Rules
from blackjack_rl.measure.grid import GRID_STATES, evaluate_grid, visits
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot, RandomBot, ThresholdBot
from blackjack_rl.measure.probe import probe_policy
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.game.solver import baselines, policy_outcome
from blackjack_rl.rollout.stepgroups import play_step_groups
from blackjack_rl.contract.tokens import trained_spans
from helpers import run_cli
from scripted import Scripted


def run(coro):
    return asyncio.run(coro)


KINDS = [tool_call_text(HIT), tool_call_text(STICK), "I would rather not say"]


def _kind(turn):
    return KINDS[random.Random(turn.seed).randrange(3)]


# --------------------------------------------------------------------------- per-token credit


def test_action_tokens_spell_the_action_word(vocab_chat):
    for action, word in ((HIT, "hit"), (STICK, "stick")):
        text = tool_call_text(action)
        ids = vocab_chat.backend.encode(text)
        idx = action_token_indices(ids, action_char_span(text), vocab_chat.backend.decode)
        assert idx and idx == list(range(idx[0], idx[-1] + 1))
        assert vocab_chat.backend.decode([ids[i] for i in idx]).strip(' "') == word


def test_step_group_advantages_separate_format_from_decision(vocab_chat, solution):
    settings = EpisodeSettings(invalid_score=-1.0, format_bonus=0.25)
    player = Player(Scripted(_kind), vocab_chat, solution, settings)
    checked = {"valid": 0, "invalid": 0}
    for seed in range(30):
        deal = run(play_step_groups(player, seed, GroupConfig(credit="step-tokens", group_size=6)))
        for result in deal.groups:
            g = result.group
            adv = g.advantages
            assert [len(a) for a in adv] == [len(t) for t in g.tokens]
            valid = [m.action is not None for m in g.episodes]
            fmt_scores = [0.25 if v else -1.0 for v in valid]
            mean = statistics.fmean(fmt_scores)
            q = g.episodes[0].q
            for tokens, masks, a, meta, f in zip(g.tokens, g.masks, adv, g.episodes, fmt_scores):
                (start, end), = trained_spans(masks)
                assert all(x == 0.0 for x in a[:start])  # the prompt carries nothing
                answer = a[start:end]
                if meta.action is None:
                    assert all(x == pytest.approx(f - mean) for x in answer)
                    checked["invalid"] += 1
                    continue
                text = vocab_chat.backend.decode(tokens[start:end])
                action_idx = set(action_token_indices(tokens[start:end], action_char_span(text),
                                                      vocab_chat.backend.decode))
                expected_decision = q[meta.action] - (q["hit"] + q["stick"]) / 2
                for i, x in enumerate(answer):
                    want = (f - mean) + (expected_decision if i in action_idx else 0.0)
                    assert x == pytest.approx(want)
                checked["valid"] += 1
    assert checked["valid"] > 50 and checked["invalid"] > 20


def test_episode_group_advantages_credit_each_decision(vocab_chat, solution):
    player = Player(Scripted(_kind), vocab_chat, solution)
    seen = 0
    for seed in range(20):
        result = run(play_group(player, seed, GroupConfig(credit="episode-tokens", group_size=4)))
        g = result.group
        for ep, tokens, masks, adv in zip(result.episodes, g.tokens, g.masks, g.advantages):
            assert len(adv) == len(tokens)
            spans = trained_spans(masks)
            assert len(spans) == len(ep.decisions)
            for (start, end), d in zip(spans, ep.decisions):
                if d.action is None:
                    assert len(set(adv[start:end])) == 1  # one validity penalty on every token
                    continue
                q = solution.q_values(d.observation, d.natural)
                values = adv[start:end]
                fmt = max(set(values), key=values.count)  # every other token: the validity credit
                assert fmt + q[d.action_id] - (q[0] + q[1]) / 2 in [pytest.approx(x) for x in values]
                seen += 1
    assert seen > 20


def test_all_action_credit_is_the_exact_expected_gradient():
    q = (-0.2, 0.1)  # hitting is better by 0.3
    p = {1: 0.25, 0: 0.75}
    forced = [AnswerCredit(True, HIT, forced=True), AnswerCredit(True, STICK, forced=True)]
    adv = decision_advantages([AnswerCredit(True, STICK), *forced], q, p)
    v = 0.25 * 0.1 + 0.75 * -0.2
    assert adv == [0.0, pytest.approx(0.25 * (0.1 - v)), pytest.approx(0.75 * (-0.2 - v))]
    # With z = logit(hit) - logit(stick): d log p(hit)/dz = 1 - p, d log p(stick)/dz = -p, so the
    # two terms give p(1 - p)(Q_hit - Q_stick) = d/dz of sum_a p(a) Q(a), the exact gradient.
    assert adv[1] * 0.75 - adv[2] * 0.25 == pytest.approx(0.25 * 0.75 * 0.3)


def test_scaled_decisions_weigh_every_state_the_same_and_the_format_has_its_own_weight(vocab_chat, solution):
    from blackjack_rl.rollout.credit import DECISION_SCALE_FLOOR, validity_advantages

    p = {1: 0.4, 0: 0.6}
    forced = [AnswerCredit(True, HIT, forced=True), AnswerCredit(True, STICK, forced=True)]
    big, small, tie = (0.55, -0.85), (-0.50, -0.40), (-0.30, -0.29)  # (Q stick, Q hit)
    scaled = {name: decision_advantages(forced, q, p, scale=True) for name, q in
              (("big", big), ("small", small), ("tie", tie))}
    # unscaled, the big gap would weigh 14x the small one; scaled, both are p(1-p) with their sign
    assert scaled["big"] == [pytest.approx(-0.24), pytest.approx(0.24)]
    assert scaled["small"] == [pytest.approx(0.24), pytest.approx(-0.24)]
    # a near tie keeps its small value scale: it must not weigh like a decision that matters
    assert scaled["tie"][0] == pytest.approx(0.24 * 0.01 / DECISION_SCALE_FLOOR)
    credits = [AnswerCredit(False, None), AnswerCredit(True, HIT), *forced]
    assert validity_advantages(credits, -1.0, 0.0, weight=0.5) == [-0.25, 0.25, 0.25, 0.25]
    # through the groups: --format-weight 0 leaves only the decision on the forced calls' tokens
    player = Player(Scripted(_kind), vocab_chat, solution, EpisodeSettings())
    deal = run(play_step_groups(player, 3, GroupConfig(credit="step-tokens", group_size=2, scale_decisions=True, format_weight=0.0)))
    for result in deal.groups:
        g = result.group
        q = g.episodes[0].q
        for adv, meta in zip(g.advantages, g.episodes):
            nonzero = {x for x in adv if x != 0.0}
            if meta.action is None:
                assert not nonzero
            else:
                gap = max(abs(q["hit"] - q["stick"]), DECISION_SCALE_FLOOR)
                want = (q[meta.action] - (q["hit"] + q["stick"]) / 2) / gap
                assert all(x == pytest.approx(want) for x in nonzero)


# --------------------------------------------------------------------------- counterfactual groups


@pytest.mark.embedded
def test_counterfactual_groups_hold_both_calls_scored_by_q_with_the_models_logprobs(embedded, solution):
    player = Player(embedded, embedded.chat, solution, EpisodeSettings(max_new_tokens=48))
    deal = run(play_step_groups(player, 7, GroupConfig(credit="step-counterfactual", group_size=3)))
    assert deal.groups
    for result in deal.groups:
        g = result.group
        meta = g.episodes
        assert [m.forced for m in meta] == [False, False, False, True, True]
        q = solution.q_values(meta[0].state, meta[0].natural)
        prompt_len = trained_spans(g.masks[0])[0][0]
        prompt = g.tokens[0][:prompt_len]
        for row, action in zip((3, 4), (HIT, STICK)):
            answer = g.tokens[row][prompt_len:]
            assert answer == embedded.chat.answer_ids(tool_call_text(action))
            assert g.scores[row] == q[action]
            # the model's own logprobs, recomputed from an empty cache token by token: the same
            # logits, though a prompt after a hit extends the opening the policy had cached
            # (docs/inference.md, "Which kernels a token meets"); only float64 rounding differs
            own = _logprobs_one_by_one(embedded, prompt, answer)
            assert g.inference_logprobs[row][prompt_len:] == pytest.approx(own, abs=1e-9)
        adv = g.advantages
        p_hit = meta[0].p_call["hit"]
        # the policy's choice between the calls is read off exactly these logprobs
        call_logprobs = [sum(g.inference_logprobs[row][prompt_len:]) for row in (3, 4)]
        assert p_hit == pytest.approx(hit_share(*call_logprobs), abs=1e-9)
        v = p_hit * q[HIT] + (1 - p_hit) * q[STICK]
        sampled_validity = statistics.fmean(0.0 if m.action is not None else -1.0 for m in meta[:3])
        decode = embedded.chat.backend.decode
        for row, action, p in ((3, HIT, p_hit), (4, STICK, 1 - p_hit)):
            answer = g.tokens[row][prompt_len:]
            idx = set(action_token_indices(answer, action_char_span(decode(answer)), decode))
            assert idx
            for i, x in enumerate(adv[row][prompt_len:]):
                # action tokens: p(a)(Q(a) - V_p); format tokens: a valid answer against the sampled ones
                assert x == pytest.approx((0.0 - sampled_validity) + (p * (q[action] - v) if i in idx else 0.0))
        # sampled answers carry no decision credit of their own in a counterfactual group
        for row in range(3):
            assert len(set(adv[row][prompt_len:])) == 1


@pytest.mark.embedded
def test_groups_of_the_two_calls_alone_follow_the_policys_own_choice(embedded, solution):
    """--group-size 0: nothing is sampled; each group is the two calls, the format measured
    against the policy's exact probability of writing one, and the episode goes on with a
    call drawn from the policy's probabilities, the same call for the same seed."""
    player = Player(embedded, embedded.chat, solution, EpisodeSettings(max_new_tokens=48))
    counts = {"hit": 0, "stick": 0}
    for seed in range(6):
        deal = run(play_step_groups(player, seed, GroupConfig(credit="step-counterfactual", group_size=0)))
        again = run(play_step_groups(player, seed, GroupConfig(credit="step-counterfactual", group_size=0)))
        assert [r.group.episodes[0].state for r in again.groups] == \
            [r.group.episodes[0].state for r in deal.groups]
        assert deal.status == "finished" and deal.groups
        for result in deal.groups:
            g = result.group
            meta = g.episodes
            assert [m.forced for m in meta] == [True, True] and [m.action for m in meta] == ["hit", "stick"]
            p_valid = meta[0].p_valid
            prompt_len = trained_spans(g.masks[0])[0][0]
            logprob_calls = [sum(g.inference_logprobs[r][prompt_len:]) for r in (0, 1)]
            assert p_valid == pytest.approx(sum(math.exp(x) for x in logprob_calls), rel=1e-6)
            fmt = 0.0 - (p_valid * 0.0 + (1 - p_valid) * -1.0)
            assert g.advantages[0][prompt_len] == pytest.approx(fmt)  # the first token is format
        # every group but the last was followed by a hit (a stick or a bust ends the deal)
        states = [r.group.episodes[0].state for r in deal.groups]
        counts["hit"] += len(states) - 1
        counts["stick"] += 1
    assert counts["hit"] > 0


def test_group_size_zero_needs_counterfactual_step_groups(tmp_path):
    import subprocess

    for extra in ([], ["--credit", "step"], ["--credit", "step-tokens"]):
        r = subprocess.run(["blackjack-rl", "process", "--policy", "optimal", "--groups", "1",
                            "--group-size", "0", *extra, "--out", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--credit step-counterfactual" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def _logprobs_one_by_one(policy, prompt, answer):
    import numpy as np

    llama = policy.llama
    llama.reset()
    llama.eval(prompt[:-1])
    llama.eval(prompt[-1:])  # alone, as the policy decodes a prompt's last token (embedded.py, _prime)
    out = []
    for tok in answer:
        logits = np.asarray(llama.scores[llama.n_tokens - 1], dtype=np.float64)
        peak = logits.max()
        out.append(float(logits[tok] - peak - np.log(np.exp(logits - peak).sum())))
        llama.eval([tok])
    llama.reset()
    return out


def test_counterfactual_groups_need_a_policy_that_scores_answers(vocab_chat, solution):
    player = Player(OptimalBot(solution), vocab_chat, solution)
    deal = run(play_step_groups(player, 3, GroupConfig(credit="step-counterfactual", group_size=2)))
    assert deal.status == "failed" and "cannot give them" in deal.error


# --------------------------------------------------------------------------- exact grid


def _bot_grid(bot, solution):
    player = Player(bot, None, solution)
    return evaluate_grid(solution, run(probe_policy(player)).p_hit)


def test_grid_of_the_bots_is_exact(solution):
    exact = baselines(Rules())
    optimal = _bot_grid(OptimalBot(solution), solution)
    assert optimal.value == pytest.approx(-0.04656, abs=5e-6)
    assert abs(optimal.value - exact["optimal"].value) < 1e-9
    assert optimal.accuracy == 1.0 and optimal.regret == pytest.approx(0.0, abs=1e-12) and optimal.hit_gap == 1.0
    stick = _bot_grid(ThresholdBot(4), solution)  # hits below 4: never
    assert abs(stick.value - exact["always_stick"].value) < 1e-9
    assert stick.value == pytest.approx(-0.18637, abs=5e-6)
    assert abs(_bot_grid(RandomBot(), solution).value - exact["random"].value) < 1e-9
    t17 = _bot_grid(ThresholdBot(17), solution)
    assert abs(t17.value - policy_outcome(Rules(), lambda s, d, u, n: float(s < 17)).value) < 1e-9
    assert t17.value < optimal.value and 0.5 < t17.accuracy < 1.0


def test_the_charts_regret_splits_over_the_cost_of_a_wrong_call(solution):
    """The bands by |Q*(hit) - Q*(stick)| hold every visited decision once, and their regrets add
    up to the chart's (V* - V over the states visited: the performance-difference lemma)."""
    from blackjack_rl.measure.grid import GAP_EDGES

    rng = random.Random(5)
    optimal = {k: float(solution.best_action(k) == HIT) for k in GRID_STATES}
    policies = [{k: rng.random() for k in GRID_STATES}, optimal, {k: float(k.player_sum < 17) for k in GRID_STATES}]
    for p_hit in policies:
        g = evaluate_grid(solution, p_hit)
        assert [b.low for b in g.by_gap] == list(GAP_EDGES) and [b.high for b in g.by_gap] == [*GAP_EDGES[1:], None]
        assert sum(b.regret for b in g.by_gap) == pytest.approx(g.regret, abs=1e-12)
        seen = sum(visits(Rules(), lambda s, d, u, n: p_hit[(s, d, u)]).values())
        assert sum(b.visits for b in g.by_gap) == pytest.approx(seen, rel=1e-12)
        assert sum(b.visits * b.accuracy for b in g.by_gap) / seen == pytest.approx(g.accuracy, rel=1e-12)
    assert all(b.regret == pytest.approx(0.0, abs=1e-12) and b.accuracy == 1.0 for b in evaluate_grid(solution, optimal).by_gap)
    # one wrong cell: its whole regret lands in its own band, as its visits times its gap
    cell = Observation(16, 10, False)
    q_stick, q_hit = solution.q_values(cell)
    gap = abs(q_hit - q_stick)
    one_wrong = {**optimal, cell: 1.0 - optimal[cell]}
    g = evaluate_grid(solution, one_wrong)
    band = max(i for i, e in enumerate(GAP_EDGES) if gap >= e)
    mass = visits(Rules(), lambda s, d, u, n: one_wrong[(s, d, u)])[(16, 10, False, False)]
    assert g.by_gap[band].regret == pytest.approx(mass * gap, rel=1e-9) == pytest.approx(g.regret, rel=1e-9)
    assert all(b.regret == pytest.approx(0.0, abs=1e-12) for i, b in enumerate(g.by_gap) if i != band)


def test_visits_conserve_the_deal_and_always_stick_decides_once(solution):
    v = visits(Rules(), lambda s, d, u, n: 0.0)
    assert sum(v.values()) == pytest.approx(1.0, abs=1e-12)
    v_hit = visits(Rules(), lambda s, d, u, n: float(s < 21))
    assert sum(v_hit.values()) > 1.5  # hitting to 21 decides more than once per deal
    assert all(k[:3] in set(GRID_STATES) for k in v_hit)


# --------------------------------------------------------------------------- a trained adapter in llama.cpp


@pytest.mark.embedded
@pytest.mark.slow
def test_a_peft_adapter_plays_the_same_in_llama_cpp(tmp_path, gguf_path):
    """A LoRA adapter trained in torch, converted to a GGUF adapter, moves llama.cpp's
    quantized model the way it moves the torch model."""
    torch = pytest.importorskip("torch", reason="needs the train extra")
    from blackjack_rl.policies.embedded import EmbeddedPolicy
    from blackjack_rl.model.io import add_lora, load_model, save_adapter
    from blackjack_rl.policies.torch.policy import TorchPolicy

    model, tokenizer = load_model(None)
    base = TorchPolicy(model, tokenizer, threads=1)
    prompt = base.chat.prompt_ids(opening_messages(Observation(13, 3, False)))
    answers = [base.chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]
    before = run(base.answer_logprobs(prompt, answers, 1.0))
    torch.manual_seed(0)
    lora = add_lora(model, 8, 16.0, layers=list(range(26, 30)))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # a move of nats: far above llama.cpp's kernel noise on AVX2 (~0.3 per call)
                p.normal_(0.0, 0.2)
    save_adapter(lora, tokenizer, tmp_path / "adapter", None)
    from blackjack_rl.model.io import export_model

    # the model dequantized from the GGUF saves as a plain model (transformers marks it as quantized)
    assert (export_model(lora, tokenizer, tmp_path / "merged") / "model.safetensors").is_file()
    trained = TorchPolicy(lora, tokenizer, threads=1)
    after = run(trained.answer_logprobs(prompt, answers, 1.0))

    plain = EmbeddedPolicy(gguf_path, n_threads=1, n_ctx=1024)
    adapted = EmbeddedPolicy(gguf_path, n_threads=1, n_ctx=1024, lora_path=tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter.gguf").is_file()
    q_before = run(plain.answer_logprobs(prompt, answers))
    q_after = run(adapted.answer_logprobs(prompt, answers))
    torch_shift = [sum(a) - sum(b) for a, b in zip(after, before)]
    llama_shift = [sum(a) - sum(b) for a, b in zip(q_after, q_before)]
    assert max(abs(x) for x in torch_shift) > 0.5  # the adapter does move the model
    for t, q in zip(torch_shift, llama_shift):
        assert abs(t - q) < 0.25 * max(abs(t), 0.5), (torch_shift, llama_shift)
    run(plain.aclose())
    run(adapted.aclose())


def test_grid_command_writes_the_exact_numbers_and_a_chart(tmp_path):
    import json

    run_ = run_cli("grid", "--policy", "threshold", "--threshold", "17", "--out", str(tmp_path / "g"), cwd=tmp_path)
    assert run_.returncode == 0, run_.stdout + run_.stderr
    g = json.loads((tmp_path / "g" / "grid.json").read_text())
    exact = policy_outcome(Rules(), lambda s, d, u, n: float(s < 17)).value
    assert abs(g["value"] - exact) < 1e-12
    assert len(g["p_hit"]) == 28 and all(len(r) == 10 for r in g["p_hit"])
    page = (tmp_path / "g" / "grid.html").read_text()
    assert "hard 16" in page and "soft 18" in page
    bad = run_cli("grid", "--policy", "openai", "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
               "--tokenizer", "nonexistent-dir", "--out", str(tmp_path / "x"), cwd=tmp_path)
    # not a folder, and the hub unreachable or without it: one line, without the hub client's retries
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "'nonexistent-dir'" in bad.stderr, bad.stderr


def test_a_game_budget_of_zero_reads_the_chart_alone(tmp_path):
    """`--game-budget 0` skips the whole-game tree (minutes for a trained model) and nothing claims
    its numbers; the option without --grid does nothing for `evaluate`, so it is refused."""
    import json

    chart = run_cli("grid", "--policy", "threshold", "--threshold", "17", "--game-budget", "0",
                    "--out", str(tmp_path / "g"), cwd=tmp_path)
    assert chart.returncode == 0, chart.stdout + chart.stderr
    g = json.loads((tmp_path / "g" / "grid.json").read_text())
    assert g["whole_game"] is None
    assert abs(g["value"] - policy_outcome(Rules(), lambda s, d, u, n: float(s < 17)).value) < 1e-12
    assert "whole game" not in chart.stdout and 'id="whole-game"' not in (tmp_path / "g" / "grid.html").read_text()
    assert "by the cost of a wrong call" in chart.stdout
    assert sum(b["regret"] for b in g["by_gap"]) == pytest.approx(g["regret"], abs=1e-12)
    full = run_cli("grid", "--policy", "threshold", "--threshold", "17", "--out", str(tmp_path / "f"), cwd=tmp_path)
    assert "whole game" in full.stdout and 'id="whole-game"' in (tmp_path / "f" / "grid.html").read_text()

    evaluated = run_cli("evaluate", "--policy", "optimal", "--episodes", "20", "--grid", "--game-budget", "0",
                        "--quiet", "--out", str(tmp_path / "e"), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["grid"]["accuracy"] == 1.0 and metrics["grid"]["whole_game"] is None
    bad = run_cli("evaluate", "--policy", "optimal", "--episodes", "20", "--game-budget", "0",
                  "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert bad.returncode == 2 and "add --grid" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()


def test_evaluate_grid_puts_the_chart_in_metrics_and_report(tmp_path):
    import json

    run_ = run_cli("evaluate", "--policy", "optimal", "--episodes", "50", "--grid", "--quiet",
                "--out", str(tmp_path / "e"), cwd=tmp_path)
    assert run_.returncode == 0, run_.stdout + run_.stderr
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["grid"]["accuracy"] == 1.0
    assert abs(metrics["grid"]["value"] - baselines(Rules())["optimal"].value) < 1e-12
    assert "Exact strategy" in (tmp_path / "e" / "report.html").read_text()


