"""The TRL fidelity callback: TRL's own advantages of the rollouts it trained, scored against A^pi."""

import json

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")
torch = pytest.importorskip("torch", reason="the train extra is not installed (pip install -e '.[train]')")

from test_adapters_trl import calls_only, trl_model  # noqa: E402,F401 - the model fixture and the call bias

from blackjack_rl.adapters.trl_env import BlackjackTRLEnv, prompt_dataset, tool_chat_tokenizer, trl_environment  # noqa: E402
from blackjack_rl.adapters.trl_fidelity import FidelityCallback, TrainedRollout, rollout_samples  # noqa: E402
from blackjack_rl.contract.protocol import HIT, STICK  # noqa: E402
from blackjack_rl.game.table import Rules, Table  # noqa: E402
from blackjack_rl.measure.probe import history_ids  # noqa: E402


def seed_where(table: Table, wanted) -> int:
    return next(s for s in range(1000) if wanted(s))


def test_each_decision_of_a_rollout_carries_its_rollouts_advantage():
    table = Table(Rules())

    def safe_hit(seed):  # a hit that does not end the hand
        table.reset(seed)
        return not table.step(HIT).terminated

    seed = seed_where(table, safe_hit)
    first = table.reset(seed)
    second = table.step(HIT).observation
    rollouts = [
        TrainedRollout(seed, ("hit", "stick"), 0.7, True),
        TrainedRollout(seed, ("stick",), -0.7, True),
        TrainedRollout(seed, ("hit", None), 1.5, True),  # the answer after the hit was not a call
        TrainedRollout(seed, (None,), -1.5, True),  # no valid call: nothing to credit
        TrainedRollout(seed, ("hit", "stick"), 2.0, False),  # re-prompted: not the canonical history
    ]
    samples = rollout_samples(rollouts, table)
    assert [(s.history, s.action, s.credit) for s in samples] == [
        ((first,), HIT, 0.7), ((first, second), STICK, 0.7),
        ((first,), STICK, -0.7),
        ((first,), HIT, 1.5),
    ]


def test_user_errors_are_one_clear_line():
    class NotGRPO:
        environment_factories = None

    with pytest.raises(ValueError, match="every") as every:
        FidelityCallback(NotGRPO(), every=0)
    with pytest.raises(ValueError, match="environment_factory") as factory:
        FidelityCallback(NotGRPO())
    for error in (every, factory):
        assert "\n" not in str(error.value)


def run(model, tokenizer, tmp_path, factory, dataset, every, steps=2, keep=100):
    """GRPOTrainer on CPU (as tests/test_adapters_trl.py runs it), optionally with the callback;
    records what TRL generated for each batch, in rollout order: each rollout's env record,
    TRL's advantage and its prompt and completion ids."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=160, max_tool_calling_iterations=2, use_cpu=True, report_to="none",
        generation_kwargs={"sequence_bias": calls_only(tokenizer)},
        logging_steps=1, save_strategy="no", temperature=1.0, learning_rate=1e-4, seed=0,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=model, processing_class=tool_chat_tokenizer(tokenizer), train_dataset=dataset,
                          environment_factory=factory, args=args)
    batches = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        rows = []
        for i, env in enumerate(trainer.environments):
            play = env.env.play
            prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
            completion = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
            rows.append({"seed": play.seed, "actions": tuple(d.action for d in play.decisions),
                         "advantage": float(out["advantages"][i]), "ids": prompt + completion,
                         "prompt": prompt})
        batches.append(rows)
        return out

    trainer._generate_and_score_completions = recorded
    callback = None
    if every:
        callback = FidelityCallback(trainer, every=every, out=tmp_path / "fidelity.jsonl", keep=keep)
        trainer.add_callback(callback)
    trainer.train()
    return trainer, batches, callback


@pytest.mark.slow
@pytest.mark.parametrize("with_dataset", [True, False])
def test_the_callback_scores_trls_own_advantages_of_the_rollouts_it_trained(trl_model, tmp_path, monkeypatch,  # noqa: F811
                                                                            with_dataset):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = trl_model
    # expected scoring: a group's rollouts that differ in any action differ in reward
    if with_dataset:
        factory, dataset = trl_environment(scoring="expected"), prompt_dataset(range(8))
    else:
        factory, dataset = trl_environment(first_seed=300, group_size=2, scoring="expected"), None
    # without a dataset, memory keeps the newest reading only; the log and the file keep both
    keep = 100 if with_dataset else 1
    trainer, batches, callback = run(model, tokenizer, tmp_path, factory, dataset, every=1, keep=keep)

    assert trainer.state.global_step == 2 and len(batches) == 2
    assert [r.step for r in callback.readings] == [1, 2][-keep:]
    lines = [json.loads(line) for line in (tmp_path / "fidelity.jsonl").read_text().splitlines()]
    logged = [row for row in trainer.state.log_history if "fidelity/credits" in row]
    assert [row["step"] for row in lines] == [row["step"] for row in logged] == [1, 2]
    table = Table(Rules())
    chat = callback._chat
    kept = len(callback.readings)
    for reading, batch, line, row in zip(callback.readings, batches[-kept:], lines[-kept:], logged[-kept:]):
        # the rollouts scored are the ones TRL generated and trained, with TRL's own advantages
        assert [(r.seed, r.actions, r.advantage) for r in reading.rollouts] == \
            [(b["seed"], b["actions"], pytest.approx(b["advantage"])) for b in batch]
        expected = []
        for b in batch:
            for j, action in enumerate(b["actions"]):
                if action is None:
                    break
                expected.append((b["seed"], j, action, b["advantage"]))
        assert len(reading.samples) == len(expected) == line["credits"] == row["fidelity/credits"]
        for s, (seed, j, action, advantage) in zip(reading.samples, expected):
            assert len(s.history) == j + 1 and s.history[0] == table.reset(seed)
            assert s.action == (HIT if action == "hit" else STICK) and s.credit == pytest.approx(advantage)
        # the truth is read at the tokens TRL showed: the prompt, and after each hit the sampled
        # call and TRL's tool turn with the new hand
        for b in batch:
            assert history_ids(chat, (table.reset(b["seed"]),)) == b["prompt"]
        for s, (seed, *_ ) in zip(reading.samples, expected):
            ids = history_ids(chat, s.history)
            assert any(ids == b["ids"][:len(ids)] for b in batch if b["seed"] == seed)
        if reading.samples:
            assert line["fidelity"]["scores"]["all"]["decisions"] == len(reading.samples)
            assert row["fidelity/decisions"] == len(reading.samples)
            assert line["fidelity_tokens"] > 0 and row["fidelity/tokens"] == line["fidelity_tokens"]
        assert line["fidelity_seconds"] >= 0.0


@pytest.mark.slow
def test_the_callback_leaves_training_as_it_was(trl_model, tmp_path, monkeypatch):  # noqa: F811
    """Two runs from the same weights and seed, one with the callback: the same rollouts, the
    same advantages and the same trained weights."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = trl_model
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = []
    for every in (0, 1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        trainer, batches, _ = run(model, tokenizer, tmp_path / str(every), BlackjackTRLEnv, prompt_dataset(range(8)),
                                  every)
        runs.append((batches, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain, plain_weights), (scored, scored_weights) = runs
    assert [[(b["ids"], b["advantage"]) for b in batch] for batch in plain] == \
        [[(b["ids"], b["advantage"]) for b in batch] for batch in scored]
    assert all(torch.equal(plain_weights[n], scored_weights[n]) for n in plain_weights)
