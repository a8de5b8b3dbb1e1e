"""The GRPO trainer: forward pass, sampling, loss direction, the CLI, the API source.

Most tests use a tiny random llama (2 layers, SmolLM2's real vocabulary and chat template),
so the mechanics are tested in seconds; the real SmolLM2 weights are only needed for the
tokenizer check (which needs no torch) and the committed run under docs/training/.
"""

from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs the train extra: pip install -e '.[train]'")

from blackjack_rl.config import GroupConfig, PolicyConfig, Settings, TrainConfig  # noqa: E402
from blackjack_rl.rollout.episodes import EpisodeSettings, opening_messages  # noqa: E402
from blackjack_rl.game.table import Observation  # noqa: E402
from blackjack_rl.rollout.players import Player  # noqa: E402
from blackjack_rl.contract.protocol import HIT, tool_call_text  # noqa: E402
from blackjack_rl.contract.tokens import MASKED, ChatFormat, HFTokenizer, trained_spans  # noqa: E402
from blackjack_rl.contract.records import ScoredDataGroup  # noqa: E402
from blackjack_rl.model.forward import RowCache, forward_rows, run_prefix  # noqa: E402
from blackjack_rl.model.io import build_hf_tokenizer, load_model  # noqa: E402
from blackjack_rl.model.logprobs import Targets, pack_rows, token_logprobs  # noqa: E402
from blackjack_rl.rollout.credit import group_advantages  # noqa: E402
from blackjack_rl.train.grpo import LossConfig, optimize, rows_of, trained_targets  # noqa: E402
from blackjack_rl.train.groups import read_group  # noqa: E402
from blackjack_rl.train.trainer import make_trainable  # noqa: E402
from blackjack_rl.policies.torch.policy import TorchPolicy  # noqa: E402
from blackjack_rl.policies.sampling import Sampling  # noqa: E402
from helpers import ServerProcess, deal_groups, poll_until, popen_cli, run_cli  # noqa: E402


@pytest.fixture()
def tiny_policy(tiny_model_dir) -> TorchPolicy:
    return TorchPolicy.load(tiny_model_dir, sampling=Sampling(temperature=1.0, max_tokens=10), threads=1)


def test_tokenizer_rebuilt_from_the_gguf_gives_llama_cpps_ids(gguf_path, tmp_path, vocab_chat):
    tok = HFTokenizer(str(build_hf_tokenizer(gguf_path, tmp_path)))
    assert (tok.tok.eos_token, tok.tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.encode("hello 123")[0] != tok.tok.bos_token_id  # no BOS is added
    chat = ChatFormat.learn(tok)
    assert (chat.end_of_turn_ids, chat.glue, chat.tail) == (vocab_chat.end_of_turn_ids, vocab_chat.glue, vocab_chat.tail)
    for obs in [Observation(15, 10, False), Observation(21, 1, True), Observation(4, 7, False)]:
        messages = opening_messages(obs)
        assert chat.prompt_ids(messages) == vocab_chat.prompt_ids(messages)
    assert chat.answer_ids(tool_call_text(HIT)) == vocab_chat.answer_ids(tool_call_text(HIT))


def test_shared_prefix_forward_equals_the_models_own(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20, 21], [5, 6, 7, 8, 30]]
    p = 4
    with torch.no_grad():
        reference = [model(torch.tensor([s])).logits[0, p:] for s in seqs]
        prefix = run_prefix(model, seqs[0][:p])
        width = max(len(s) for s in seqs) - p
        ids = torch.tensor([s[p:] + [0] * (width - len(s) + p) for s in seqs])
        valid = torch.tensor([[1] * (len(s) - p) + [0] * (width - len(s) + p) for s in seqs]).bool()
        positions = p + torch.arange(width)[None].expand(len(seqs), -1)
        logits = model.lm_head(forward_rows(model, ids, positions, valid, prefix).hidden)
        # the same, token by token through the preallocated cache, as sampling runs it
        cache = RowCache.allocate(model, len(seqs), width, torch.float32)
        steps = [forward_rows(model, ids[:, j : j + 1], positions[:, j : j + 1], valid[:, j : j + 1], prefix, cache)
                 for j in range(width)]
        cached = model.lm_head(torch.cat([o.hidden for o in steps], dim=1))
    for i, s in enumerate(seqs):
        n = len(s) - p
        torch.testing.assert_close(logits[i, :n], reference[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached[i, :n], reference[i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("first_layer", "recorded"), [(0, False), (1, False), (1, True)])
def test_packed_rows_give_each_sequences_own_logprobs_and_gradients(tiny_model_dir, first_layer, recorded):
    """Siblings that share a start beyond the common prefix run as one row (the shared start
    once); every logprob and every gradient must still be that of the sequence run alone."""
    model, _ = load_model(tiny_model_dir)
    p = 3
    seqs = [
        [5, 6, 7, 8, 9, 10, 11, 12, 13],  # the head of a row
        [5, 6, 7, 8, 9, 10, 11, 40, 41],  # leaves it late: joins its row
        [5, 6, 7, 8, 9, 10],  # a prefix of it: adds nothing
        [5, 6, 7, 8, 9, 10, 11, 12, 13],  # a duplicate
        [5, 6, 7, 30, 31, 32, 33],  # shares only the common prefix: its own row
    ]
    positions = [(r, j) for r, s in enumerate(seqs) for j in range(p + 1, len(s))]
    targets = Targets(
        rows=torch.tensor([r for r, _ in positions]), positions=torch.tensor([j for _, j in positions]),
        tokens=torch.tensor([seqs[r][j] for r, j in positions]), old_logprobs=None,
    )
    packed = pack_rows(seqs, [len(s) for s in seqs], p)
    assert packed.ids.shape[0] == 2  # three sequences joined the first row's
    params = [q for q in model.parameters()]
    temperature = 0.7
    model.zero_grad()
    reference = []
    for r, j in positions:
        logits = model(torch.tensor([seqs[r][:j]])).logits[0, -1].float() / temperature
        reference.append(torch.log_softmax(logits, dim=-1)[seqs[r][j]])
    reference = torch.stack(reference)
    reference.sum().backward()
    expected = [q.grad.clone() for q in params]
    model.zero_grad()
    states = None
    if recorded:  # the frozen trunk's states as sampling records them, one sequence at a time
        with torch.no_grad():
            states = {tuple(q): model(torch.tensor([q]), output_hidden_states=True).hidden_states[first_layer][0]
                      for q in seqs}
    got = token_logprobs(model, seqs, targets, temperature, first_layer=first_layer, states=states)
    got.sum().backward()
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    core = model.model
    # with the layers below `first_layer` frozen, the layers above and the final norm carry gradients
    above = params if first_layer == 0 else [*core.layers[first_layer:].parameters(), *core.norm.parameters()]
    for q, g in zip(params, expected):
        if any(q is a for a in above):
            # float32 sums in another order (BLAS kernels differ by CPU): equal to a part in 1e-4 of
            # the gradient's size, where a wrong attention mask or a lost path differs by order one
            assert float((q.grad - g).norm()) <= 1e-4 * float(g.norm()) + 1e-6


def test_packing_is_skipped_where_one_wide_row_would_pad_many_narrow_ones():
    family = [[*range(10, 40), 200 + i, 300 + i] for i in range(20)]  # 30 shared tokens, 2 of their own
    loners = [[1000 + i, 7, 8] for i in range(40)]
    seqs = family + loners
    packed = pack_rows(seqs, [len(s) for s in seqs], 0)
    assert packed.ids.shape[0] == len(seqs)  # 41 rows of 70 would be more work than 60 of 32
    alone = pack_rows(family, [len(s) for s in family], 0)
    assert alone.ids.shape[0] == 1  # by themselves the siblings share one row


@pytest.mark.parametrize("group_by", ["step", "episode"])
def test_sampled_logprobs_are_what_training_computes(tiny_policy, solution, group_by):
    player = Player(tiny_policy, tiny_policy.chat, solution, EpisodeSettings())
    tiny_policy.sample_with(tiny_policy.model, frozen_below=1)  # as the trainer hands it a model
    with tiny_policy.recording() as states:
        [result] = deal_groups(player, 7, GroupConfig(group_size=4, credit=group_by))[:1]
    assert states, "sampling recorded the trunk's states"
    group = result.group  # as a trainer receives it
    targets = trained_targets(group)
    assert targets.old_logprobs is not None and len(targets.rows) > 0
    with torch.no_grad():
        full = token_logprobs(tiny_policy.model, group.tokens, targets, 1.0)
        trunk = token_logprobs(tiny_policy.model, group.tokens, targets, 1.0, first_layer=1)
        recorded = token_logprobs(tiny_policy.model, group.tokens, targets, 1.0, first_layer=1, states=states)
    for got in (full, trunk, recorded):
        torch.testing.assert_close(got, targets.old_logprobs, atol=1e-4, rtol=1e-4)
    with tiny_policy.recording() as outside:
        pass
    deal_groups(player, 8, GroupConfig(group_size=2, credit=group_by))
    assert not outside, "nothing is recorded outside `recording`"
    # each answer is exactly what was sampled: it ends on a stop token or at max_tokens
    for seq, mask in zip(group.tokens, group.masks):
        for start, end in trained_spans(mask):
            assert seq[end - 1] in tiny_policy.stop or end - start == tiny_policy.max_tokens


def _synthetic_group(chat: ChatFormat, good: list[int], bad: list[int],
                     scores: tuple[float, ...] = (1.0, -1.0, 1.0, -1.0)) -> ScoredDataGroup:
    """Two answers to one prompt, twice each: `good` scores 1, `bad` scores -1."""
    prompt = chat.prompt_ids(opening_messages(Observation(15, 10, False)))
    tokens, masks = [], []
    for answer in (good, bad, good, bad):
        tokens.append(prompt + answer)
        masks.append([MASKED] * len(prompt) + answer)
    return read_group({"tokens": tokens, "masks": masks, "scores": list(scores)})


def _answer_logprob(model, group, row: int) -> float:
    targets = trained_targets(group)
    with torch.no_grad():
        lp = token_logprobs(model, group.tokens, targets, 1.0)
    return float(lp[targets.rows == row].sum())


@pytest.mark.slow  # torch training
@pytest.mark.parametrize("variant", [{}, {"lora": True, "lr": 1e-2}, {"train_layers": 1}])
def test_one_step_moves_probability_to_the_higher_scored_answer(tiny_model_dir, variant):
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat.learn(tokenizer)
    good = chat.answer_ids(tool_call_text(HIT))
    bad = chat.answer_ids("I think I will hit, because 15 is low against a 10.")
    group = _synthetic_group(chat, good, bad)
    settings = Settings(train=TrainConfig(**{"lr": 1e-3, **variant}))
    model = make_trainable(model, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    good_before, bad_before = _answer_logprob(model, group, 0), _answer_logprob(model, group, 1)
    optimizer = torch.optim.AdamW(params, lr=settings.train.lr)
    layers = model.config.num_hidden_layers if not hasattr(model, "peft_config") else 2
    first_layer = layers - settings.train.train_layers if settings.train.train_layers else 0
    stats = optimize(model, optimizer, params, [group], LossConfig(), settings, None, first_layer)
    assert stats["trained_groups"] == 1 and stats["clipped"] == 0.0
    assert any(not torch.equal(b, p) for b, p in zip(before, params)), "the weights changed"
    assert _answer_logprob(model, group, 0) > good_before + 0.05
    assert _answer_logprob(model, group, 1) < bad_before - 0.05


@pytest.mark.slow  # torch training
def test_groups_without_signal_are_not_trained(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat.learn(tokenizer)
    group = _synthetic_group(chat, chat.answer_ids("a"), chat.answer_ids("b"), scores=(-1.0,) * 4)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    stats = optimize(model, torch.optim.AdamW(params, lr=1e-2), params, [group], LossConfig(), Settings(), None)
    assert stats == {"trained_groups": 0, "trained_sequences": 0}
    assert all(torch.equal(b, p) for b, p in zip(before, params))


def test_group_advantages():
    assert group_advantages([1.0, -1.0]) == [1.0, -1.0]
    assert group_advantages([2.0, 0.0], scale=False) == [1.0, -1.0]
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


@pytest.mark.slow  # torch training
def test_train_writes_log_curves_and_a_model_that_evaluate_loads(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run = run_cli("train", "--model-path", str(tiny_model_dir), "--steps", "2", "--deals-per-step", "2",
               "--group-size", "4", "--credit", "step", "--max-tokens", "6", "--eval-episodes", "3",
               "--eval-every", "1", "--save-every", "1", "--lora", "--threads", "1", "--max-batch", "8",
               "--game-budget", "300", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("eval", 0), ("grid", 0), ("step", 1), ("eval", 1), ("step", 2), ("eval", 2)
    ]
    step = rows[2]
    for key in ("grid_accuracy", "grid_value", "grid_p_hit_hit_optimal", "grid_p_hit_stick_optimal"):
        assert key in step and key in rows[1]
    for row in (rows[1], step):  # the whole game beside the chart: an interval around its value
        assert sum(b["regret"] for b in row["grid_by_gap"]) == pytest.approx(row["grid_regret"], abs=1e-12)
        assert -1.0 - 1e-9 <= row["game_value_low"] <= row["game_value"] <= row["game_value_high"] <= 1.0 + 1e-9
    for key in ("mean_score", "valid_call_rate", "decision_accuracy", "sample_tokens_per_s", "trained_groups"):
        assert key in step
    assert set(rows[0]["summary"]) >= {"valid_decisions", "win", "decision_accuracy", "mean_reward"}
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert (out / "checkpoints" / "step_0001" / "adapter_model.safetensors").is_file()
    assert "train" in (out / "command.txt").read_text()
    assert json.loads((out / "settings.json").read_text())["policy"]["max_batch"] == 8

    ev = run_cli("evaluate", "--policy", "hf", "--model-path", str(out / "model"), "--episodes", "3",
              "--max-tokens", "6", "--threads", "1", "--quiet", "--out", str(tmp_path / "ev"), cwd=tmp_path)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["episodes_played"] == 3 and metrics["policy"]["policy"] == "hf"


def test_train_rejects_other_policies(tmp_path):
    """--policy is no flag of train (tests/test_recipes.py); a settings file cannot pick another player either."""
    (tmp_path / "bot.yaml").write_text("policy: {kind: random}\n")
    run = run_cli("train", "--config", str(tmp_path / "bot.yaml"), "--out", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2 and "samples with its own torch model" in run.stderr


def test_the_torch_batch_size_is_its_own_setting(tiny_model_dir):
    """--max-batch sizes the torch policy's sampling batches whatever --concurrency says; the
    policies that do not batch that way refuse it, in one line."""
    from blackjack_rl.config import EvalConfig
    from blackjack_rl.policies import check_supported, make_policy

    policy = PolicyConfig(kind="hf", model_path=str(tiny_model_dir), max_batch=8, n_threads=1)
    built = make_policy(Settings(policy=policy, evaluate=EvalConfig(concurrency=3)))
    assert built.policy.max_batch == 8
    for other in ({"kind": "embedded"}, {"kind": "openai", "model": "m"}, {"kind": "random"}):
        with pytest.raises(ValueError, match="--max-batch") as refused:
            check_supported(PolicyConfig(**other, max_batch=8))
        assert "\n" not in str(refused.value)


@pytest.mark.slow  # torch training
def test_trains_on_batches_pulled_from_the_trajectory_api(tiny_policy, solution, tmp_path):
    import httpx

    from blackjack_rl.train.sources import ApiSource

    player = Player(tiny_policy, tiny_policy.chat, solution, EpisodeSettings(scoring="expected"))
    groups = [r.group.to_json() for seed in (1, 2)
              for r in deal_groups(player, seed, GroupConfig(group_size=4))]
    groups[0]["scores"] = [1.0, -1.0, 0.5, -0.5]  # make sure at least one group carries signal
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        source = ApiSource(api.url, token=None, batch_size=8, max_token_len=1024, steps=1,
                           checkpoint_dir=str(tmp_path), save_every=0, timeout_s=30)
        response = httpx.post(f"{api.url}/scored_data_list", json=groups, timeout=10)
        assert response.status_code == 200, response.text
        pulled, info = source.next_groups()
        source.close()
    finally:
        api.stop()
    assert len(pulled) == 2 and info["redelivered"] is False
    assert all(isinstance(g, ScoredDataGroup) for g in pulled)  # read into the typed group, records typed
    assert pulled[0].tokens == groups[0]["tokens"] and pulled[0].scores == groups[0]["scores"]
    assert [r.to_json() for r in pulled[1].episodes] == groups[1]["episodes"]
    model = tiny_policy.model
    params = list(model.parameters())
    stats = optimize(model, torch.optim.AdamW(params, lr=1e-3), params, pulled, LossConfig(), Settings(), None)
    assert stats["trained_groups"] >= 1 and stats["logprob_gap"] < 1e-3  # same weights sampled them


@pytest.mark.slow  # torch training
def test_a_trainer_on_the_api_scores_the_pulled_credit_against_its_own_policy(tiny_policy, tiny_model_dir,
                                                                               solution, tmp_path):
    """`train --source api --fidelity-every 1`: the batch another policy played (a random bot) is
    scored against A^pi of the trainer's policy, labelled so, beside the step it trains."""
    import httpx

    from blackjack_rl.policies.bots import RandomBot

    player = Player(RandomBot(), tiny_policy.chat, solution, EpisodeSettings(scoring="expected"))
    groups = [r.group.to_json() for seed in (1, 2) for r in deal_groups(player, seed, GroupConfig(group_size=4))]
    groups[0]["scores"] = [1.0, -1.0, 0.5, -0.5]
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        train = popen_cli("train", "--source", "api", "--api-url", api.url, "--batch-size", "8", "--steps", "1",
                          "--model-path", str(tiny_model_dir), "--max-tokens", "10", "--eval-episodes", "0",
                          "--grid-every", "0", "--fidelity-every", "1", "--threads", "1", "--batch-timeout", "300",
                          "--out", str(tmp_path / "run"))
        poll_until(lambda: httpx.get(f"{api.url}/info", timeout=10).json()["batch_size"] == 8, attempts=3000,
                   what="the trainer registering")  # then the groups go in
        response = httpx.post(f"{api.url}/scored_data_list", json=groups, timeout=10)
        assert response.status_code == 200, response.text
        out, _ = train.communicate(timeout=600)
        assert train.returncode == 0, out
    finally:
        api.stop()
    rows = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    step = [r for r in rows if r["kind"] == "step"][0]
    assert step["fidelity_of"] == "batch" and step["fidelity_policy"] == "trainer"
    assert step["fidelity"]["scores"]["all"]["decisions"] >= 8  # every episode's decisions, placed


@pytest.mark.slow  # torch training
def test_per_token_credit_moves_the_decision_and_not_the_format(tiny_model_dir):
    """A group of a hit and a stick call whose only credit is on the action token: one step
    raises the better action's probability, and the format tokens barely move."""
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat.learn(tokenizer)
    prompt = chat.prompt_ids(opening_messages(Observation(12, 6, False)))
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(0))]
    tokens = [[*prompt, *c] for c in calls]
    masks = [[MASKED] * len(prompt) + list(c) for c in calls]
    decode = tokenizer.decode
    from blackjack_rl.rollout.credit import action_char_span, action_token_indices

    action = [set(action_token_indices(c, action_char_span(decode(c)), decode)) for c in calls]
    # hitting is better here: +0.3 on the hit token, -0.3 on the stick token, 0 elsewhere
    advantages = [
        [0.0] * len(prompt) + [(0.3 if i in action[0] else 0.0) for i in range(len(calls[0]))],
        [0.0] * len(prompt) + [(-0.3 if i in action[1] else 0.0) for i in range(len(calls[1]))],
    ]
    group = read_group({"tokens": tokens, "masks": masks, "scores": [0.0, 0.0], "advantages": advantages})
    targets = trained_targets(group)

    def logprobs():
        with torch.no_grad():
            return token_logprobs(model, tokens, targets, 1.0)

    before = logprobs()
    group = group.model_copy(update={"inference_logprobs": [
        [1.0] * len(prompt) + before[targets.rows == r].tolist() for r in (0, 1)]})
    settings = Settings(train=TrainConfig(lr=3e-3))
    model = make_trainable(model, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    stats = optimize(model, torch.optim.AdamW(params, lr=3e-3), params, [group], LossConfig(), settings, None)
    assert stats["trained_groups"] == 1
    delta = (logprobs() - before).tolist()
    rows, positions = targets.rows.tolist(), targets.positions.tolist()
    is_action = [positions[k] - len(prompt) in action[rows[k]] for k in range(len(rows))]
    hit_gain = sum(d for d, r, a in zip(delta, rows, is_action) if a and r == 0)
    stick_gain = sum(d for d, r, a in zip(delta, rows, is_action) if a and r == 1)
    format_moves = [abs(d) for d, a in zip(delta, is_action) if not a]
    assert hit_gain > 0.05 and stick_gain < -0.05
    assert sum(format_moves) / len(format_moves) < 0.2 * (hit_gain - stick_gain)


@pytest.mark.slow  # torch training
def test_a_resumed_run_takes_the_same_next_step(tiny_model_dir, tmp_path):
    common = ["--model-path", str(tiny_model_dir), "--deals-per-step", "2", "--group-size", "3", "--credit",
              "step-counterfactual", "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "0",
              "--save-every", "1", "--threads", "1", "--lr", "1e-3", "--seed", "5", "--warmup-steps", "4",
              "--decay-steps", "2"]
    whole = run_cli("train", *common, "--steps", "3", "--out", str(tmp_path / "whole"), cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    resumed = run_cli("train", *common, "--steps", "3", "--resume", str(tmp_path / "whole" / "checkpoints" / "step_0001"),
                   "--out", str(tmp_path / "resumed"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout

    def step_rows(path):
        return [json.loads(x) for x in (path / "train_log.jsonl").read_text().splitlines() if '"step"' in x]

    a = [r for r in step_rows(tmp_path / "whole") if r["kind"] == "step" and r["step"] == 2][0]
    b = [r for r in step_rows(tmp_path / "resumed") if r["kind"] == "step" and r["step"] == 2][0]
    for key in ("mean_score", "trained_groups", "sequences", "sampled_tokens"):
        assert a[key] == b[key], key
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    # the warm-up goes on where it stopped: step 2 of 4 runs at half the learning rate; the decay
    # over the last 2 of 3 steps takes the last one to a third, below the warm-up's 3/4
    def lr(path, step):
        return [r for r in step_rows(path) if r["kind"] == "step" and r["step"] == step][0]["lr"]

    assert lr(tmp_path / "whole", 1) == pytest.approx(0.25e-3) and a["lr"] == b["lr"] == pytest.approx(0.5e-3)
    assert lr(tmp_path / "whole", 3) == lr(tmp_path / "resumed", 3) == pytest.approx(1e-3 / 3)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_resume_from_a_folder_without_trainer_state_is_one_line(tiny_model_dir, tmp_path):
    run = run_cli("train", "--model-path", str(tiny_model_dir), "--steps", "1", "--resume", str(tmp_path),
               "--eval-episodes", "0", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode != 0 and "trainer_state.pt" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr


def test_groups_trained_together_take_the_same_step_as_one_by_one(tiny_model_dir):
    """Merging the groups of a batch into large forwards is only a speed-up: the gradient of
    a scalar-advantage group and a per-token one is the same as when each runs alone."""
    from blackjack_rl.train.grpo import group_loss, merge_groups, scalar_advantages

    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat.learn(tokenizer)
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(0))]
    scalar = _synthetic_group(chat, calls[0], chat.answer_ids("no idea"))
    prompt = chat.prompt_ids(opening_messages(Observation(16, 10, False)))
    per_token = read_group({
        "tokens": [[*prompt, *c] for c in calls],
        "masks": [[MASKED] * len(prompt) + list(c) for c in calls],
        "scores": [0.0, 0.0],
        "advantages": [[0.0] * len(prompt) + [0.1 * (i % 3) for i in range(len(c))] for c in calls],
    })
    work = [(g, scalar_advantages(g, True)) for g in (scalar, per_token)]
    assert work[0][1] is not None and work[1][1] is None  # the per-token group's own advantages take precedence
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(batches):
        model.zero_grad(set_to_none=True)
        for rows in batches:
            group_loss(model, rows, LossConfig()).loss.backward()
        return [p.grad.clone() for p in params if p.grad is not None]

    alone = grads([rows_of(g, adv) for g, adv in work])
    together = grads(merge_groups(work, max_rows=3))
    assert len(merge_groups(work, max_rows=3)) == 2  # 6 sequences, 3 per forward
    assert len(alone) == len(together) > 0
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # without a KL term, tokens of zero advantage are left out: fewer trained tokens, the same step
    lean = merge_groups(work, max_rows=3, drop_zero=True)
    trained = [sum(m != MASKED for rows in merged for row in rows.masks for m in row)
               for merged in (merge_groups(work, 3), lean)]
    assert trained[1] < trained[0]
    for a, b in zip(alone, grads(lean)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_calls_shared_tokens_go_through_the_vocabulary_head_once(tiny_policy):
    """The hit and stick calls agree up to the action word, and so do their states: the head
    and its softmax (most of a scoring's cost) run once per distinct state, and every call's
    logprobs are what it gets scored alone."""
    from blackjack_rl.model.forward import causal_lm

    chat = tiny_policy.chat
    hit, stick = chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(0))
    shared = next(i for i, (a, b) in enumerate(zip(hit, stick)) if a != b)
    prompt = chat.prompt_ids(opening_messages(Observation(13, 7, False)))
    head, rows = causal_lm(tiny_policy.model).lm_head, []
    hook = head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        together = tiny_policy.score_answers([(prompt, [hit, stick])], 1.0)
        alone = [tiny_policy.score_answers([(prompt, [call])], 1.0)[0] for call in (hit, stick)]
    finally:
        hook.remove()
    # the action word's own logprob is read at the last state they share: 1 + shared states in common
    assert rows[0] == len(hit) + len(stick) - shared - 1  # not len(hit) + len(stick)
    for got, want in zip(together, alone):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_scorings_chunks_run_their_shared_prefix_once(tiny_policy, monkeypatch):
    """Answers asked together are scored in chunks (bounded memory); the system prompt they all
    share runs once for all of them, and the logprobs are those of chunks that each run it."""
    import blackjack_rl.model.logprobs as logprobs
    import blackjack_rl.policies.torch.policy as torch_policy

    chat = tiny_policy.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(0))]
    # each chunk's two hands part at their first field, so every chunk shares the same prefix
    hands = [(13, 2), (8, 7), (15, 3), (9, 10), (17, 4), (6, 5)]
    prompts = [chat.prompt_ids(opening_messages(Observation(s, d, False))) for s, d in hands]
    monkeypatch.setattr(torch_policy, "_SCORE_CHUNK", 2)
    runs = []
    run_prefix = logprobs.run_prefix
    monkeypatch.setattr(logprobs, "run_prefix", lambda *a, **k: (runs.append(1), run_prefix(*a, **k))[1])

    async def together():
        return await asyncio.gather(*(tiny_policy.answer_logprobs(p, calls) for p in prompts))

    batched = asyncio.run(together())
    assert len(runs) == 1  # three chunks, one prefix
    chunks = [tiny_policy.score_answers([(p, calls) for p in prompts[i : i + 2]], 1.0) for i in range(0, 6, 2)]
    assert len(runs) == 4  # each chunk that runs its own prefix runs it again
    assert [logps for got in batched for logps in got] == [logps for chunk in chunks for logps in chunk]  # bit for bit


def test_answer_scores_asked_together_are_batched_and_equal_to_one_by_one(tiny_policy, vocab_chat):
    """The forced calls of every deal of a step are scored in shared forwards (the system
    prompt runs once), with the same logprobs as when each deal asks alone."""
    chat = tiny_policy.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(0))]
    prompts = [chat.prompt_ids(opening_messages(Observation(s, d, False))) for s in (8, 13, 17) for d in (2, 7, 10)]
    alone = [asyncio.run(tiny_policy.answer_logprobs(p, calls)) for p in prompts]
    forwards = []
    score = tiny_policy.score_answers
    tiny_policy.score_answers = lambda items, t, *rest: (forwards.append(len(items)), score(items, t, *rest))[1]

    async def together():
        return await asyncio.gather(*(tiny_policy.answer_logprobs(p, calls) for p in prompts))

    batched = asyncio.run(together())
    assert forwards == [len(prompts)]  # one forward for all nine deals
    for a, b in zip(alone, batched):
        for x, y in zip(a, b):
            assert x == pytest.approx(y, abs=1e-4)


def test_batch_metrics_read_the_policys_call_probabilities_from_two_call_groups(tiny_policy, solution):
    """Groups of the two forced calls alone sample nothing; the log still shows, exactly and for
    free, how likely the policy is to write a call and how often it would hit, by optimal action."""
    from blackjack_rl.train.metrics import batch_metrics

    player = Player(tiny_policy, tiny_policy.chat, solution, EpisodeSettings())
    config = GroupConfig(credit="step-counterfactual", group_size=0)
    groups = [r.group for seed in range(6) for r in deal_groups(player, seed, config)]
    assert groups and all(len(g.tokens) == 2 for g in groups)
    m = batch_metrics(groups)
    assert m["mean_score"] is None and m["decisions"] == 0  # nothing was sampled
    firsts = [g.episodes[0] for g in groups]
    assert m["p_valid_call"] == pytest.approx(sum(f.p_valid for f in firsts) / len(firsts))
    for optimal, key in (("hit", "p_hit_hit_optimal"), ("stick", "p_hit_stick_optimal")):
        mine = [f.p_call["hit"] for f in firsts if f.optimal == optimal]
        assert m[key] == (pytest.approx(sum(mine) / len(mine)) if mine else None)


def _two_call_groups(policy, solution, seeds, continue_with: str = "sampled") -> list[ScoredDataGroup]:
    player = Player(policy, policy.chat, solution, EpisodeSettings())
    config = GroupConfig(credit="step-counterfactual", group_size=0, continue_with=continue_with)
    return [r.group for seed in seeds for r in deal_groups(player, seed, config)]


def test_balanced_actions_weigh_hit_and_stick_optimal_decisions_equally(tiny_policy, solution):
    from blackjack_rl.train.grpo import action_balance

    groups = _two_call_groups(tiny_policy, solution, range(12))
    optimal = [g.episodes[0].optimal for g in groups]
    assert optimal.count("hit") != optimal.count("stick")  # these deals are unbalanced
    foreign = read_group({"tokens": [[1, 2]], "masks": [[MASKED, 2]], "scores": [1.0],
                          "episodes": [{"something": "else"}]})  # another environment's group
    weights = action_balance([*groups, foreign])
    assert weights[-1] == 1.0
    totals = {a: sum(w for w, o in zip(weights, optimal) if o == a) for a in ("hit", "stick")}
    assert totals["hit"] == pytest.approx(totals["stick"]) == pytest.approx(len(groups) / 2)
    one_class = [g for g, o in zip(groups, optimal) if o == "hit"]
    assert action_balance(one_class) == [1.0] * len(one_class)  # nothing to balance against


def test_balancing_later_decisions_apart_weighs_each_turn_set_by_action(tiny_policy, solution):
    """--balance-later: among first decisions and among decisions after a hit, hit-optimal and
    stick-optimal weigh the same, and each set keeps its own total weight."""
    from blackjack_rl.train.grpo import action_balance

    groups = _two_call_groups(tiny_policy, solution, range(40), continue_with="best")  # hits where optimal
    keys = [(g.episodes[0].decision > 0, g.episodes[0].optimal) for g in groups]
    counts = {k: keys.count(k) for k in set(keys)}
    assert len(counts) == 4 and len({counts[(True, a)] / counts[(False, a)] for a in ("hit", "stick")}) == 2
    weights = action_balance(groups, by_turn=True)
    for later in (False, True):
        size = counts[(later, "hit")] + counts[(later, "stick")]
        for a in ("hit", "stick"):
            total = sum(w for w, k in zip(weights, keys) if k == (later, a))
            assert total == pytest.approx(size / 2)
    # balanced over the whole batch only, the later decisions' own classes stay unequal
    flat = action_balance(groups)
    later = {a: sum(w for w, k in zip(flat, keys) if k == (True, a)) for a in ("hit", "stick")}
    assert later["hit"] != pytest.approx(later["stick"])


def test_balance_later_needs_balanced_actions_and_later_decisions():
    with pytest.raises(ValueError, match="needs --balance-actions"):
        GroupConfig(credit="step-counterfactual", group_size=0, balance_later=True)
    with pytest.raises(ValueError, match="--decisions first never makes"):
        GroupConfig(credit="step-counterfactual", group_size=0, balance_actions=True, balance_later=True,
                    decisions="first")
    with pytest.raises(ValueError, match="is for step groups"):
        GroupConfig(credit="episode", balance_later=True)


def test_balance_actions_takes_the_step_of_the_weighted_groups(tiny_model_dir, tiny_policy, solution):
    """--balance-actions is the same step as training on groups whose advantages were weighted."""
    from blackjack_rl.train.grpo import action_balance, weighted

    groups = _two_call_groups(tiny_policy, solution, range(12))
    by_action = {a: [g for g in groups if g.episodes[0].optimal == a] for a in ("hit", "stick")}
    groups = by_action["hit"][:3] + by_action["stick"][:1]  # three to one
    manual = [weighted(g, None, w)[0] for g, w in zip(groups, action_balance(groups))]
    assert manual != groups
    after = []
    for balance, batch in ((True, groups), (False, manual)):
        model, _ = load_model(tiny_model_dir)
        settings = Settings(groups=GroupConfig(credit="step-counterfactual", group_size=0, balance_actions=balance))
        params = [p for p in model.parameters() if p.requires_grad]
        optimize(model, torch.optim.SGD(params, lr=1.0), params, batch, LossConfig(), settings, None)
        after.append(torch.cat([p.detach().flatten() for p in params]))
    assert torch.equal(after[0], after[1])
    model, _ = load_model(tiny_model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimize(model, torch.optim.SGD(params, lr=1.0), params, groups, LossConfig(), Settings(), None)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in params]), after[0])


def test_a_lone_answer_scored_above_a_frozen_trunk_equals_the_full_forward(tiny_policy, vocab_chat):
    """With the lower layers frozen, their states are computed once per new sequence; a single
    new sequence (all of it a "shared prefix") used to leave no states to compute and failed."""
    chat = tiny_policy.chat
    prompt = chat.prompt_ids(opening_messages(Observation(15, 10, False)))
    call = [chat.answer_ids(tool_call_text(HIT))]
    full = asyncio.run(tiny_policy.answer_logprobs(prompt, call))
    tiny_policy.sample_with(tiny_policy.model, frozen_below=1)
    split = asyncio.run(tiny_policy.answer_logprobs(prompt, call))
    assert split[0] == pytest.approx(full[0], abs=1e-4)


def test_a_run_started_from_a_saved_adapter_continues_that_adapter(tiny_model_dir, tmp_path):
    """--init-adapter: the second run's step-0 chart is the first run's final one (the same
    weights), and its final adapter is one adapter over the base model, not a stack."""
    common = ["--model-path", str(tiny_model_dir), "--deals-per-step", "2", "--group-size", "0", "--credit",
              "step-counterfactual", "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "1",
              "--game-budget", "0", "--threads", "1", "--lr", "1e-2", "--lora", "--steps", "1"]
    first = run_cli("train", *common, "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli("train", *common, "--seed", "1", "--init-adapter", str(tmp_path / "one" / "adapter"),
                     "--out", str(tmp_path / "two"), cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr

    def grid_rows(path):
        rows = [json.loads(x) for x in (path / "train_log.jsonl").read_text().splitlines()]
        return [[p for row in r["grid_p_hit"] for p in row] for r in rows if "grid_p_hit" in r]

    end_of_first, start_of_second = grid_rows(tmp_path / "one")[-1], grid_rows(tmp_path / "two")[0]
    assert start_of_second == pytest.approx(end_of_first, abs=1e-5)
    assert start_of_second != pytest.approx(grid_rows(tmp_path / "one")[0], abs=1e-5)  # the first run moved it
    config = json.loads((tmp_path / "two" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == json.loads(
        (tmp_path / "one" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]

    wrong = run_cli("train", *common, "--lora-rank", "4", "--init-adapter", str(tmp_path / "one" / "adapter"),
                    "--out", str(tmp_path / "three"), cwd=tmp_path)
    assert wrong.returncode != 0 and "--lora-rank" in wrong.stderr and "Traceback" not in wrong.stderr
    no_lora = common[:common.index("--lora")]
    plain = run_cli("train", *no_lora, "--init-adapter", str(tmp_path / "one" / "adapter"),
                    "--out", str(tmp_path / "four"), cwd=tmp_path)
    assert plain.returncode != 0 and "needs --lora" in plain.stderr and "Traceback" not in plain.stderr


def test_a_fresh_adapter_over_a_saved_one_is_saved_as_one_exact_adapter(tiny_model_dir, tmp_path):
    """--base-adapter: the saved adapter is folded in (the second run starts where the first
    ended), a fresh one trains over it, and what is saved is both as one adapter over the base
    model: a third run over that stack starts exactly where the second ended."""
    common = ["--model-path", str(tiny_model_dir), "--deals-per-step", "2", "--group-size", "0", "--credit",
              "step-counterfactual", "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "1",
              "--game-budget", "0", "--threads", "1", "--lr", "1e-2", "--lora", "--lora-rank", "4"]

    def grid_rows(path):
        rows = [json.loads(x) for x in (path / "train_log.jsonl").read_text().splitlines()]
        return [[p for row in r["grid_p_hit"] for p in row] for r in rows if "grid_p_hit" in r]

    first = run_cli("train", *common, "--steps", "1", "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli("train", *common, "--steps", "2", "--save-every", "1", "--seed", "1", "--base-adapter",
                     str(tmp_path / "one" / "adapter"), "--out", str(tmp_path / "two"), cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert grid_rows(tmp_path / "two")[0] == pytest.approx(grid_rows(tmp_path / "one")[-1], abs=1e-5)
    assert grid_rows(tmp_path / "two")[-1] != pytest.approx(grid_rows(tmp_path / "two")[0], abs=1e-5)
    stack = json.loads((tmp_path / "two" / "adapter" / "adapter_config.json").read_text())
    assert stack["r"] == 8 and stack["lora_alpha"] == 8.0
    assert not (tmp_path / "two" / "adapter" / ".fresh").exists()

    third = run_cli("train", *common, "--steps", "1", "--lora-rank", "2", "--base-adapter",
                    str(tmp_path / "two" / "adapter"), "--out", str(tmp_path / "three"), cwd=tmp_path)
    assert third.returncode == 0, third.stdout + third.stderr
    assert grid_rows(tmp_path / "three")[0] == pytest.approx(grid_rows(tmp_path / "two")[-1], abs=1e-5)

    checkpoint = str(tmp_path / "two" / "checkpoints" / "step_0001")
    resumed = run_cli("train", *common, "--steps", "2", "--base-adapter", str(tmp_path / "one" / "adapter"),
                      "--resume", checkpoint, "--out", str(tmp_path / "resumed"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for wrong in (["--resume", checkpoint], ["--init-adapter", str(tmp_path / "one" / "adapter"), "--base-adapter",
                                             str(tmp_path / "one" / "adapter")]):
        bad = run_cli("train", *common, "--steps", "2", *wrong, "--out", str(tmp_path / "bad"), cwd=tmp_path)
        assert bad.returncode != 0 and "--base-adapter" in bad.stderr and "Traceback" not in bad.stderr
    no_lora = common[:common.index("--lora")]
    plain = run_cli("train", *no_lora, "--steps", "1", "--base-adapter", str(tmp_path / "one" / "adapter"),
                    "--out", str(tmp_path / "four"), cwd=tmp_path)
    assert plain.returncode != 0 and "needs --lora" in plain.stderr and "Traceback" not in plain.stderr


def test_stacked_lora_weights_sum_the_parts_exactly():
    from blackjack_rl.model.lora_stack import stacked_config, stacked_weights

    torch.manual_seed(0)
    q, v = "base_model.model.model.layers.1.self_attn.q_proj", "base_model.model.model.layers.1.self_attn.v_proj"
    one = {f"{q}.lora_A.weight": torch.randn(4, 8), f"{q}.lora_B.weight": torch.randn(6, 4),
           f"{v}.lora_A.weight": torch.randn(4, 8), f"{v}.lora_B.weight": torch.randn(3, 4)}
    two = {f"{q}.lora_A.weight": torch.randn(2, 8), f"{q}.lora_B.weight": torch.randn(6, 2)}
    out = stacked_weights([(one, 0.5), (two, 3.0)])
    for module, parts in ((q, [(one, 0.5), (two, 3.0)]), (v, [(one, 0.5)])):
        want = sum(s * w[f"{module}.lora_B.weight"] @ w[f"{module}.lora_A.weight"] for w, s in parts)
        got = out[f"{module}.lora_B.weight"] @ out[f"{module}.lora_A.weight"]
        assert out[f"{module}.lora_A.weight"].shape[0] == 6  # every module has the summed rank
        assert torch.allclose(got, want, atol=1e-5)
    config = stacked_config([{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                              "layers_to_transform": [1]},
                             {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "layers_to_transform": [1, 2]}])
    assert config["r"] == 6 and config["lora_alpha"] == 6.0
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["layers_to_transform"] == [1, 2]
