"""Sticky routing in the server pool: an episode's turns and a group's answers stay on one server.

Two real mock vLLM servers on 127.0.0.1 log every prompt (token ids) they answered. A
later turn's prompt extends an earlier turn's prompt of the same episode, and every
answer of a group extends the group's shared prompt, so "the same episode or group"
is "one prompt is a prefix of the other": such requests must have hit the same server.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.runner import run_evaluation
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy
from blackjack_rl.policies.pool import ServerPool, ServerSpec, affinity_key, rendezvous_order
from blackjack_rl.policies.sampling import Sampling
from mock_openai_server import MockServer, blackjack_answers, write_config

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, vocab_chat):
    config = write_config(tmp_path_factory.mktemp("mock") / "answers.json", blackjack_answers(vocab_chat),
                          vocab_chat.end_of_turn_ids[0])
    pair = [MockServer(config), MockServer(config)]
    yield pair
    for s in pair:
        s.kill()


def play(servers, chat, solution, sticky: bool, fault: dict | None = None, **pool_args):
    for s in servers:
        s.control(reset=True)
        s.control(latency_ms=5)
    if fault is not None:
        servers[0].control(**fault)
    pool_args.setdefault("timeout", 10.0)
    pool = ServerPool([ServerSpec(s.url) for s in servers], backoff_s=0.01, sticky=sticky, **pool_args)
    policy = OpenAICompletionsPolicy(pool, "mock", chat, sampling=Sampling(max_tokens=48), token_path="completions")
    player = Player(policy, chat, solution)

    async def main():
        try:
            limiter = asyncio.Semaphore(16)
            groups = await asyncio.gather(*(play_group(player, seed, GroupConfig(group_size=4), limiter=limiter) for seed in range(12)))
            episodes = await run_evaluation(player, 60, concurrency=16)
            return groups, episodes, pool.snapshot()
        finally:
            await policy.aclose()

    return asyncio.run(asyncio.wait_for(main(), 120))


def split_conversations(servers) -> int:
    """Pairs of requests of one conversation (one prompt extends the other) answered by different servers."""
    prompts = [(tuple(entry["prompt"]), i) for i, s in enumerate(servers) for entry in s.stats()["log"]]
    prompts.sort()
    split = 0
    for (a, server_a), (b, server_b) in zip(prompts, prompts[1:]):  # a prefix sorts right before its extensions
        if b[:len(a)] == a and server_a != server_b:
            split += 1
    return split


def test_an_episode_and_a_group_stay_on_one_server(servers, vocab_chat, solution):
    groups, episodes, snapshot = play(servers, vocab_chat, solution, sticky=True)
    assert all(g.group is not None for g in groups) and not any(ep.failed for ep in episodes)
    multi_turn = sum(len(ep.decisions) > 1 for ep in episodes)
    assert multi_turn > 0  # there are later turns to keep together
    assert split_conversations(servers) == 0
    assert all(s.stats()["requests"].get("/v1/completions", 0) > 0 for s in servers)  # both share the load
    assert sum(s["sticky_spilled_in"] for s in snapshot) == 0


def test_without_stickiness_conversations_are_split(servers, vocab_chat, solution):
    """The check above can fail: least-loaded routing scatters the turns of an episode."""
    play(servers, vocab_chat, solution, sticky=False)
    assert split_conversations(servers) > 0


@pytest.mark.parametrize("fault, timeout", [({"status": 500}, 10.0), ({"hang": True}, 0.5)], ids=["500", "silent"])
def test_a_failing_server_moves_its_conversations_to_the_next_choice(servers, vocab_chat, solution, fault, timeout):
    try:
        groups, episodes, snapshot = play(servers, vocab_chat, solution, sticky=True, fault=fault, retries=2,
                                          quarantine_after=2, quarantine_s=60, timeout=timeout)
    finally:
        servers[0].control(reset=True)
    assert all(g.group is not None for g in groups) and not any(ep.failed for ep in episodes)
    by_url = {s["url"]: s for s in snapshot}
    assert not by_url[servers[0].url]["healthy"]
    assert by_url[servers[1].url]["sticky_spilled_in"] > 0  # keys whose first choice was the failing server


def test_rendezvous_follows_the_weights_and_moves_only_the_keys_of_a_removed_server():
    urls, weights = ["http://a", "http://b", "http://c"], [2.0, 1.0, 1.0]
    keys = [f"Your hand {k}" for k in range(4000)]
    first = {k: urls[rendezvous_order(k, urls, weights)[0]] for k in keys}
    share = Counter(first.values())
    assert 1800 < share["http://a"] < 2200 and 800 < share["http://b"] < 1200
    without_c = {k: ["http://a", "http://b"][rendezvous_order(k, urls[:2], weights[:2])[0]] for k in keys}
    assert all(without_c[k] == first[k] for k in keys if first[k] != "http://c")
    # the failover order is the ranking with the removed server left out
    assert all(without_c[k] == urls[next(i for i in rendezvous_order(k, urls, weights) if i != 2)] for k in keys)


def test_the_key_is_the_first_user_message():
    opening = [{"role": "system", "content": "rules"}, {"role": "user", "content": "hand 1"}]
    later = opening + [{"role": "assistant", "content": "hit"}, {"role": "user", "content": "hand 2"}]
    assert affinity_key(opening) == affinity_key(later) == "hand 1"
    assert affinity_key([{"role": "system", "content": "rules"}]) is None


@pytest.mark.parametrize("flags, sticky", [([], True), (["--no-sticky"], False)])
def test_the_command_line_switches_stickiness(flags, sticky, gguf_path):
    from blackjack_rl.cli import build_parser, settings_from_args
    from blackjack_rl.rollout.players import build_player

    args = build_parser().parse_args(["evaluate", "--policy", "openai", "--model", "m", "--server",
                                      "http://127.0.0.1:9/v1", "--token-path", "completions", "--tokenizer",
                                      str(gguf_path), *flags])
    player = build_player(settings_from_args(args))
    try:
        assert player.policy.pool.sticky is sticky
    finally:
        asyncio.run(player.policy.aclose())
