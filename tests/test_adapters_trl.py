"""The TRL adapter: scripted rollouts against BlackjackEnv, and TRL's GRPOTrainer for two steps on CPU."""

import itertools

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")
torch = pytest.importorskip("torch", reason="the train extra is not installed (pip install -e '.[train]')")

from blackjack_rl.adapters.trl_env import (  # noqa: E402
    BlackjackTRLEnv,
    blackjack_reward,
    prompt_dataset,
    prompt_rows,
    tool_chat_tokenizer,
    trl_environment,
)
from blackjack_rl.env import BlackjackEnv, EnvSettings  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.contract.protocol import TOOL_NAME, tool_call_text  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402


def replay(seed: int, completion: list[dict], settings: EnvSettings = EnvSettings()) -> float:
    """Our own loop on TRL's rollout: each call TRL ran (its result follows the call) is one
    answer; the message TRL ran no call of ends the rollout, an answer without a call."""
    env = BlackjackEnv(solve(Rules()), settings)
    env.reset(seed)
    for i, message in enumerate(completion):
        if message["role"] != "assistant" or env.done:
            continue
        results = list(itertools.takewhile(lambda m: m["role"] == "tool", completion[i + 1:]))
        for call in (message.get("tool_calls") or [])[:len(results)]:  # TRL runs every call of a message
            if not env.done:
                env.step("", [call])
    if not env.done:
        env.step("", None, allow_retry=False)
    return env.play.score


def call(action: str) -> dict:
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"action": action}}}


def play_script(env, actions, final):
    """A rollout as TRL builds it: each call and its result, then the message with no call."""
    completion = []
    for action in actions:
        try:
            result = env.take_action(action)
        except RuntimeError as exc:
            result = {"error": str(exc)}
        completion += [{"role": "assistant", "content": "", "tool_calls": [call(action)]},
                       {"role": "tool", "name": TOOL_NAME, "content": str(result)}]
    completion.append({"role": "assistant", "content": final})
    return completion


SCRIPTS = [
    (["stick"], ""),
    (["hit", "hit", "stick"], ""),
    (["hit"], "I think I am done."),
    (["hit"], tool_call_text(0)),  # a call TRL's parser did not find: the rollout ended without it
    (["stand"], ""),
    ([], "no call at all"),
]


@pytest.mark.parametrize("actions,final", SCRIPTS)
def test_scripted_rollouts_score_as_our_env(actions, final):
    settings = {"scoring": "expected", "format_bonus": 0.3}
    factory = trl_environment(**settings)
    for seed in range(12):
        env = factory()
        assert env.reset(seed=seed, prompt=prompt_rows([seed])[0]["prompt"]) is None
        completion = play_script(env, actions, final)
        reward = env.get_reward()
        assert reward == env.get_reward() == replay(seed, completion, EnvSettings(**settings))
        assert blackjack_reward([completion], [env]) == [reward]


def test_one_instance_plays_batch_after_batch_as_fresh_ones_do():
    pooled = BlackjackTRLEnv()
    for round_ in range(3):
        for seed, (actions, final) in enumerate(SCRIPTS):
            fresh = BlackjackTRLEnv()
            rewards = []
            for env in (pooled, fresh):
                env.reset(seed=seed + 100 * round_, prompt=[{"role": "user", "content": "the deal"}])
                completion = play_script(env, actions, final)
                rewards.append(env.get_reward())
            assert rewards[0] == rewards[1] == replay(seed + 100 * round_, completion)
            assert pooled.env.play.decisions == fresh.env.play.decisions


def test_without_a_dataset_reset_deals_the_factorys_seeds_and_returns_the_prompt():
    factory = trl_environment(first_seed=40, group_size=2)
    envs = [factory() for _ in range(3)]
    core = BlackjackEnv(solve(Rules()))
    shown = []
    for env in envs + envs:  # TRL's placeholder row: one empty user turn
        shown.append((env.reset(prompt=[{"role": "user", "content": ""}]), env.env.play.seed))
    assert [seed for _, seed in shown] == [40, 40, 41, 41, 42, 42]
    for text, seed in shown:
        messages, _ = core.reset(seed)
        assert text == messages[0]["content"] + "\n\n" + messages[1]["content"]
    # a row of seeds only: that seed, and its prompt
    assert envs[0].reset(seed=7) == "\n\n".join(m["content"] for m in core.reset(7)[0])
    fresh = trl_environment()()  # each factory counts its own deals
    fresh.reset()
    assert fresh.env.play.seed == 0


def test_user_errors_are_one_clear_line():
    with pytest.raises(ValueError, match="seed") as row:
        BlackjackTRLEnv().reset(prompt=[{"role": "user", "content": "a deal"}])
    with pytest.raises(ValueError, match="group_size") as group:
        trl_environment(group_size=0)
    with pytest.raises(RuntimeError, match="reset") as early:
        BlackjackTRLEnv().get_reward()
    env = BlackjackTRLEnv()
    env.reset(seed=1)
    with pytest.raises(ValueError, match="drop reward_funcs=blackjack_reward") as twice:
        blackjack_reward([[]], [env], trainer_state=object())
    for error in (row, group, early, twice):
        assert "\n" not in str(error.value)


def test_the_dataset_shows_the_deal_of_its_seed():
    rows = prompt_dataset(range(3))
    env = BlackjackEnv(solve(Rules()))
    assert [row["prompt"] for row in rows] == [env.reset(s)[0] for s in range(3)]


@pytest.fixture(scope="module")
def trl_model(tiny_model_dir, hf_tokenizer_dir):
    """A 2-layer llama with SmolLM2's vocabulary (conftest's `tiny_model_dir`), trainable float32,
    and SmolLM2's tokenizer rebuilt from the GGUF. Every answer is forced to a call (`calls_only`),
    so what these tests check is TRL's tool loop, rewards and advantages against ours, which do not
    depend on the model's size; the 135M model made each TRL run a minute of prefill."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


def test_the_smollm2_template_passes_trls_tool_check_and_parses_our_calls(trl_model):
    from trl.chat_template_utils import parse_response, supports_tool_calling

    _, tokenizer = trl_model
    assert not supports_tool_calling(tokenizer)  # SmolLM2's own template has no tool role
    tokenizer = tool_chat_tokenizer(tokenizer)
    assert supports_tool_calling(tokenizer)
    [row] = prompt_rows([3])
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=[BlackjackTRLEnv().take_action],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = tokenizer.encode(tool_call_text(1) + "<|im_end|>", add_special_tokens=False)
    parsed = parse_response(tokenizer, ids, prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": TOOL_NAME, "arguments": {"action": "hit"}}
    assert tool_chat_tokenizer(tokenizer).chat_template == tokenizer.chat_template  # idempotent


def calls_only(tokenizer) -> list:
    """transformers' `sequence_bias` that makes every answer a take_action call, hit or stick as
    the model prefers: each token of the call text is favoured once the tokens before it are written.
    A small model rarely writes a call of its own, and TRL's tool loop is what the test is about."""
    calls = [tokenizer.encode(tool_call_text(action) + "<|im_end|>", add_special_tokens=False) for action in (0, 1)]
    return [[call[:k + 1], 100.0] for call in calls for k in range(len(call))]


def run_grpo(model, tokenizer, tmp_path, factory, dataset, steps=2):
    """GRPOTrainer on CPU, every answer a call (see calls_only), rewarded by the environment's
    get_reward() alone; returns TRL's completions with the seeds they were dealt, the rewards
    TRL got, and the trainer."""
    from trl import GRPOConfig, GRPOTrainer

    played, rewarded = [], []

    def record(completions, environments, **kwargs):  # sees TRL's completions; adds nothing (None)
        played.extend((env.env.play.seed, completion) for env, completion in zip(environments, completions))
        return [None] * len(completions)

    class Recorded(factory):
        def get_reward(self) -> float:
            reward = super().get_reward()
            rewarded.append((self.env.play.seed, reward))
            return reward

    Recorded.__name__ = factory.__name__
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=96, max_tool_calling_iterations=2, use_cpu=True, report_to="none",
        generation_kwargs={"sequence_bias": calls_only(tokenizer)},
        logging_steps=1, save_strategy="no", temperature=1.0, learning_rate=1e-4, seed=0,
        gradient_checkpointing=False,  # TRL 1.x turns it on, and generation then runs without its KV cache
    )
    trainer = GRPOTrainer(model=model, processing_class=tool_chat_tokenizer(tokenizer), train_dataset=dataset,
                          environment_factory=Recorded, reward_funcs=[record], args=args)
    trainer.train()
    return played, rewarded, trainer


@pytest.mark.slow
def test_grpo_trainer_trains_two_steps_and_its_rewards_are_ours(trl_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = trl_model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    played, rewarded, trainer = run_grpo(model, tokenizer, tmp_path, BlackjackTRLEnv, prompt_dataset(range(8)))

    assert trainer.state.global_step == 2 and len(played) == len(rewarded) == 4
    assert [seed for seed, _ in played] == [seed for seed, _ in rewarded]
    assert len({seed for seed, _ in played[:2]}) == 1  # a group shares its row's deal
    for (seed, completion), (_, reward) in zip(played, rewarded):
        assert reward == replay(seed, completion)
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    rewards = [r for _, r in rewarded]
    assert logged == pytest.approx([sum(rewards[:2]) / 2, sum(rewards[2:]) / 2])
    # every reward equal means no advantage and no update; a learning signal changes the weights
    if len(set(rewards)) > 1:
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.slow
def test_grpo_trainer_needs_no_dataset(trl_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = trl_model
    played, rewarded, trainer = run_grpo(model, tokenizer, tmp_path, trl_environment(first_seed=500, group_size=2), None, steps=1)

    assert trainer.state.global_step == 1
    assert [seed for seed, _ in played] == [seed for seed, _ in rewarded] == [500, 500]  # one deal per group
    for (seed, completion), (_, reward) in zip(played, rewarded):
        assert reward == replay(seed, completion)
