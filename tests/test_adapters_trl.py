"""The TRL adapter: scripted rollouts against BlackjackEnv, and TRL's GRPOTrainer for two steps on CPU."""


import pytest

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")
torch = pytest.importorskip("torch", reason="the train extra is not installed (pip install -e '.[train]')")

from blackjack_rl.adapters.trl_env import (  # noqa: E402
    BlackjackTRLEnv,
    blackjack_reward,
    prompt_dataset,
    tool_chat_tokenizer,
    trl_environment,
)
from blackjack_rl.env import BlackjackEnv, EnvSettings  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.contract.protocol import TOOL_NAME, tool_call_text  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402


def replay(seed: int, completion: list[dict], settings: EnvSettings = EnvSettings()) -> float:
    """What our own loop scores for the same answers: every assistant message is one answer."""
    env = BlackjackEnv(solve(Rules()), settings)
    env.reset(seed)
    for message in completion:
        if message["role"] != "assistant" or env.done:
            continue
        calls = message.get("tool_calls") or None
        for call in calls or [None]:  # TRL runs every call of a message, each a turn of ours
            if not env.done:
                env.step(message.get("content") or "", [call] if call else None, allow_retry=calls is not None)
    if not env.done:
        env.truncate("rollout_ended")
    return env.play.score


def call(action: str) -> dict:
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"action": action}}}


@pytest.mark.parametrize("actions,final", [
    (["stick"], ""),
    (["hit", "hit", "stick"], ""),
    (["hit"], "I think I am done."),
    (["hit"], tool_call_text(0)),  # a call TRL did not parse, read by ours
    (["stand"], ""),
    ([], "no call at all"),
])
def test_scripted_rollouts_score_as_our_env(actions, final):
    factory = trl_environment(scoring="expected", format_bonus=0.3)
    for seed in range(12):
        env = factory()
        assert env.reset(seed=seed, prompt=[]) is None
        completion = []
        for action in actions:
            try:
                result = env.take_action(action)
            except RuntimeError as exc:
                result = {"error": str(exc)}
            completion += [{"role": "assistant", "content": "", "tool_calls": [call(action)]},
                           {"role": "tool", "name": TOOL_NAME, "content": str(result)}]
        completion.append({"role": "assistant", "content": final})
        [reward] = blackjack_reward([completion], [env])
        assert reward == replay(seed, completion, EnvSettings(scoring="expected", format_bonus=0.3))


def test_a_row_without_a_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        BlackjackTRLEnv().reset(prompt=[])


def test_the_dataset_shows_the_deal_of_its_seed():
    rows = prompt_dataset(range(3))
    env = BlackjackEnv(solve(Rules()))
    assert [row["prompt"] for row in rows] == [env.reset(s)[0] for s in range(3)]


@pytest.fixture(scope="module")
def smollm2(hf_tokenizer_dir):
    """SmolLM2-135M from the embedded GGUF (no download), as a plain trainable float32 model, and its
    tokenizer rebuilt from the GGUF's vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blackjack_rl.policies.torch.model import load_model

    model, _ = load_model(None)
    config = model.config
    if hasattr(config, "quantization_config"):  # the model came from a GGUF: train the dequantized weights
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    return plain, tool_chat_tokenizer(AutoTokenizer.from_pretrained(str(hf_tokenizer_dir)))


def test_the_tokenizer_renders_and_parses_our_tool_calls(smollm2):
    from trl.chat_template_utils import parse_response

    _, tokenizer = smollm2
    ids = tokenizer.encode(tool_call_text(1) + "<|im_end|>", add_special_tokens=False)
    parsed = parse_response(tokenizer, ids)
    assert parsed["tool_calls"][0]["function"] == {"name": TOOL_NAME, "arguments": {"action": "hit"}}


@pytest.mark.slow
def test_grpo_trainer_trains_two_steps_and_its_rewards_are_ours(smollm2, tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = smollm2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def recorded_reward(completions, environments, **kwargs):
        rewards = blackjack_reward(completions, environments, **kwargs)
        seen.extend((env.env.play.seed, completion, reward) for env, completion, reward in zip(environments, completions, rewards))
        return rewards

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=16, max_tool_calling_iterations=1, use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", temperature=1.0, learning_rate=1e-4, seed=0,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine one thread is faster than two contended ones
    try:
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=prompt_dataset(range(8)),
                              environment_factory=BlackjackTRLEnv, reward_funcs=recorded_reward, args=args)
        trainer.train()
    finally:
        torch.set_num_threads(threads)

    assert trainer.state.global_step == 2 and len(seen) == 4
    for seed, completion, reward in seen:
        assert reward == replay(seed, completion)
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert logged == pytest.approx([sum(r for _, _, r in seen[:2]) / 2, sum(r for _, _, r in seen[2:]) / 2])
    # every reward equal means no advantage and no update; a learning signal changes the weights
    if any(r != seen[0][2] for _, _, r in seen):
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
