"""One deal set played through every adapter and through `evaluate`'s loop: same deal, same parses, same rewards."""

import asyncio

import gymnasium
import pytest

import blackjack_rl.adapters  # noqa: F401  (registers the Gymnasium id)
from blackjack_rl.rollout.episodes import EpisodeSettings
from blackjack_rl.rollout.runner import eval_seeds, run_evaluation
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import Reply
from blackjack_rl.contract.protocol import HIT, STICK, parse_action, tool_call_text

OPTIONS = {"scoring": "expected", "format_bonus": 0.25}
DEALS = 20


def script(deal: str) -> list[str]:
    """The answers for a deal, chosen by its opening hand (which every entry point shows):
    a stick, hit-then-stick, a hit then prose, or a bare JSON call then a stick."""
    hit, stick = tool_call_text(HIT), tool_call_text(STICK)
    plans = [[stick], [hit, stick], [hit, "I'll stand, thanks."], ['{"name": "take_action", "arguments": {"action": "hit"}}', stick]]
    return plans[sum(map(ord, deal)) % 4]


class Scripted:
    """evaluate's policy: answers by the script of the deal it is shown."""

    name = "scripted"

    def generation_params(self):
        return {}

    async def respond(self, turn):
        answered = sum(m["role"] == "assistant" for m in turn.messages)
        return Reply(script(turn.messages[1]["content"])[answered])

    async def aclose(self):
        pass


def parse_view(parse: dict) -> tuple:
    return parse["valid"], parse["action"], parse["error"]


def via_gymnasium(seed):
    env = gymnasium.make("blackjack_rl/BlackjackText-v0", **OPTIONS)
    obs, info = env.reset(seed=seed)
    deal = obs
    parses, total = [], 0.0
    for answer in script(deal):
        obs, reward, terminated, truncated, info = env.step(answer)
        parses.append(parse_view(info["parse"]))
        total += reward
        if terminated or truncated:
            break
    return deal, parses, total


def via_skyrl(seed):
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="the skyrl extra is not installed")
    import blackjack_rl.adapters.skyrl_env  # noqa: F401  (registers `blackjack_rl` with skyrl-gym)

    env = skyrl_gym.make("blackjack_rl", env_config=OPTIONS, extras={"seed": seed})
    prompt, _ = env.init(None)
    parses, total = [], 0.0
    for answer in script(prompt[-1]["content"]):
        out = env.step(answer)
        parses.append(parse_view(out["metadata"]["parse"]))
        total += out["reward"]
        if out["done"]:
            break
    return prompt[-1]["content"], parses, total


def via_openenv(seed):
    pytest.importorskip("openenv", reason="the openenv extra is not installed")
    from blackjack_rl.adapters.openenv import BlackjackAction, BlackjackEnvironment
    from blackjack_rl.env import EnvSettings

    env = BlackjackEnvironment(settings=EnvSettings(**OPTIONS))
    first = env.reset(seed=seed).messages[-1]["content"]
    parses, total = [], 0.0
    for answer in script(first):
        obs = env.step(BlackjackAction(answer=answer))
        parses.append(parse_view(obs.info["parse"]))
        total += obs.reward
        if obs.done:
            break
    return first, parses, total


def via_trl(seed):
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from blackjack_rl.adapters.trl_env import blackjack_reward, prompt_rows, trl_environment

    [row] = prompt_rows([seed])
    deal = row["prompt"][-1]["content"]
    env = trl_environment(**OPTIONS)()
    env.reset(**row)
    completion = []
    for answer in script(deal):
        parsed = parse_action(answer)
        if not parsed.valid or not answer.startswith("<tool_call>"):  # TRL's parser sees no call: the rollout ends
            completion.append({"role": "assistant", "content": answer})
            break
        action = "hit" if parsed.action == HIT else "stick"
        completion.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "take_action", "arguments": {"action": action}}}]})
        completion.append({"role": "tool", "name": "take_action", "content": env.take_action(action)})
        if env.env.done:
            break
    [reward] = blackjack_reward([completion], [env])
    play = env.env.play
    parses = [(d.action is not None, d.action, d.parse_error) for d in play.decisions]
    return deal, parses, reward


def via_verifiers(seed):
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed")
    from blackjack_rl.adapters.verifiers_env import load_environment

    env = load_environment(num_train_deals=1, num_eval_deals=DEALS, **OPTIONS)
    [row] = [r for r in env.eval_dataset if r["info"]["seed"] == seed]
    deal = row["prompt"][-1]["content"]

    async def play():
        state = {"info": row["info"]}
        await env.setup_state(state)
        messages = list(row["prompt"])
        for answer in script(deal):
            messages.append({"role": "assistant", "content": answer})
            messages += await env.env_response(messages, state)
            if state.get("final_env_response") is not None:
                break
        return state, await env.episode_score(state)

    state, reward = asyncio.run(play())
    return deal, [parse_view(step["parse"]) for step in state["blackjack_steps"]], reward


def test_every_adapter_and_evaluate_agree_on_deal_parses_and_rewards(vocab_chat, solution):
    player = Player(Scripted(), vocab_chat, solution, EpisodeSettings(**OPTIONS))
    episodes = asyncio.run(run_evaluation(player, DEALS))
    assert [ep.seed for ep in episodes] == list(eval_seeds(DEALS))
    plans = set()
    for ep in episodes:
        deal = ep.messages[1]["content"]
        plans.add(tuple(script(deal)))
        parses = [(d.action is not None, d.action, d.parse_error) for d in ep.decisions]
        expected = (deal, parses, pytest.approx(ep.score))
        assert ep.score is not None
        for adapter in (via_gymnasium, via_skyrl, via_openenv, via_verifiers):
            assert adapter(ep.seed) == expected, adapter.__name__
        if all(answer.startswith("<tool_call>") or not parse_action(answer).valid for answer in script(deal)):
            assert via_trl(ep.seed) == expected, "via_trl"
        else:  # a bare JSON call is no call to TRL's parser: its rollout ends there (docs/adapters.md)
            assert via_trl(ep.seed)[0] == deal
    assert len(plans) >= 3  # the deals exercised several scripts
