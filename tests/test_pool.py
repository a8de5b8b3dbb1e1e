"""The server pool under faults: 500s, timeouts, malformed JSON, hung and dying servers.

Every server is a real HTTP server on 127.0.0.1 in its own process (the vLLM mock), so
a hang is a real hang and a death is a real kill by PID. Every loop is bounded in
count and in time (`asyncio.wait_for`), so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.runner import eval_seeds, run_evaluation
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import InferenceError, Turn
from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy
from blackjack_rl.policies.pool import NoHealthyServer, ServerPool, ServerSpec
from blackjack_rl.policies.sampling import Sampling
from mock_openai_server import MockServer, blackjack_answers, free_port, write_config

pytestmark = pytest.mark.timeout(180)
TURN = Turn([], [1, 2, 3], None, False, 0)


@pytest.fixture(scope="module")
def config(tmp_path_factory, vocab_chat):
    return write_config(tmp_path_factory.mktemp("mock") / "answers.json", blackjack_answers(vocab_chat),
                        vocab_chat.end_of_turn_ids[0])


@pytest.fixture(scope="module")
def servers(config):
    pair = [MockServer(config), MockServer(config)]
    yield pair
    for s in pair:
        s.kill()


@pytest.fixture
def a(servers):
    servers[0].control(reset=True)
    return servers[0]


@pytest.fixture
def b(servers):
    servers[1].control(reset=True)
    return servers[1]


def make(urls, chat, **pool_args):
    pool_args.setdefault("timeout", 10.0)
    pool_args.setdefault("backoff_s", 0.01)
    specs = [u if isinstance(u, ServerSpec) else ServerSpec(u) for u in urls]
    return OpenAICompletionsPolicy(ServerPool(specs, **pool_args), "mock", chat, sampling=Sampling(max_tokens=48),
                                   token_path="completions")


def run(coro, limit=60):
    return asyncio.run(asyncio.wait_for(coro, limit))


async def closing(policy, coro):
    try:
        return await coro
    finally:
        await policy.aclose()


def completions(server):
    return server.stats()["requests"].get("/v1/completions", 0)


# -- retries: only 5xx and timeouts ---------------------------------------------------


def test_500s_are_retried_with_backoff_and_then_succeed(a, vocab_chat):
    a.control(status=500, fail_times=2)
    policy = make([a.url], vocab_chat, retries=2)
    reply = run(closing(policy, policy.respond(TURN)))
    assert reply.completion_ids and completions(a) == 3


def test_persistent_500s_give_up_after_the_retries(a, vocab_chat):
    a.control(status=503)
    policy = make([a.url], vocab_chat, retries=2, quarantine_after=10)
    with pytest.raises(InferenceError, match="after 3 attempts.*HTTP 503"):
        run(closing(policy, policy.respond(TURN)))
    assert completions(a) == 3


@pytest.mark.parametrize("fault", [{"status": 400}, {"status": 422}, {"malformed": True}])
def test_client_errors_and_malformed_json_are_not_retried(a, vocab_chat, fault):
    a.control(**fault)
    policy = make([a.url], vocab_chat, retries=3)
    with pytest.raises(InferenceError, match="HTTP 4|invalid JSON"):
        run(closing(policy, policy.respond(TURN)))
    assert completions(a) == 1


def test_a_hung_server_times_out_and_is_retried(a, vocab_chat):
    a.control(hang=True)
    policy = make([a.url], vocab_chat, retries=1, timeout=0.5)
    with pytest.raises(InferenceError, match="timed out after 0.5s"):
        run(closing(policy, policy.respond(TURN)))  # bounded by run()'s limit: a missing timeout fails here
    assert completions(a) == 2


# -- routing, caps, quarantine --------------------------------------------------------


def test_the_per_server_cap_holds_and_nothing_deadlocks_at_cap_1(a, vocab_chat, solution):
    """Cap 1 on the server, one episode at a time, and a group's shared first turn: completes."""
    a.control(latency_ms=5)
    policy = make([a.url], vocab_chat, max_concurrency=1)
    player = Player(policy, vocab_chat, solution)

    async def main():
        limiter = asyncio.Semaphore(1)
        groups = [await play_group(player, seed, GroupConfig(group_size=4), limiter=limiter) for seed in range(3)]
        episodes = await run_evaluation(player, 12, concurrency=1)
        burst = await asyncio.gather(*(policy.respond(TURN) for _ in range(20)))
        return groups, episodes, burst

    groups, episodes, burst = run(closing(policy, main()), limit=60)
    assert all(g.group is not None for g in groups)
    assert not any(ep.failed for ep in episodes) and len(burst) == 20
    assert a.stats()["max_in_flight"] == 1


def test_load_follows_the_weights(a, b, vocab_chat):
    a.control(latency_ms=100)
    b.control(latency_ms=100)
    policy = make([ServerSpec(a.url, weight=3.0), ServerSpec(b.url, weight=1.0)], vocab_chat)

    async def main():
        return await asyncio.gather(*(policy.respond(TURN) for _ in range(40)))

    run(closing(policy, main()))
    heavy, light = completions(a), completions(b)
    assert heavy + light == 40 and heavy >= 2 * light > 0


def test_a_failing_server_is_quarantined_and_its_work_goes_elsewhere(a, b, vocab_chat):
    a.control(status=500)
    policy = make([a.url, b.url], vocab_chat, retries=2, quarantine_after=2, quarantine_s=30)

    async def main():
        first = await asyncio.gather(*(policy.respond(TURN) for _ in range(30)))  # half start on a
        sent_to_a = completions(a)
        second = await asyncio.gather(*(policy.respond(TURN) for _ in range(30)))
        return first + second, sent_to_a

    replies, sent_to_a = run(closing(policy, main()))
    assert len(replies) == 60 and completions(b) >= 60
    assert completions(a) == sent_to_a  # no work for a once it is quarantined
    snap = {s["url"]: s for s in policy.pool.snapshot()}
    assert not snap[a.url]["healthy"] and "HTTP 500" in snap[a.url]["last_error"]


def test_a_quarantined_server_is_probed_back_into_rotation(a, vocab_chat):
    a.control(status=500, fail_times=2)
    policy = make([a.url], vocab_chat, retries=0, quarantine_after=2, quarantine_s=0.2)

    async def main():
        for _ in range(2):
            with pytest.raises(InferenceError):
                await policy.respond(TURN)
        # fails without waiting (a wait at the cap would end in ServerBusy, not NoHealthyServer)
        # and without a request, naming the server and its last error
        with pytest.raises(NoHealthyServer, match=f"{a.url}.*quarantined.*HTTP 500"):
            await policy.respond(TURN)
        assert completions(a) == 2
        await asyncio.sleep(0.3)  # the quarantine is over: the next request starts a probe and waits for it
        return await policy.respond(TURN)

    assert run(closing(policy, main())).completion_ids
    assert [s["healthy"] for s in policy.pool.snapshot()] == [True]


def test_with_every_server_down_requests_fail_fast_with_a_clear_error(vocab_chat, solution):
    dead = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    policy = make(dead, vocab_chat, retries=1, quarantine_after=1, quarantine_s=60)
    player = Player(policy, vocab_chat, solution)

    episodes = run(closing(policy, run_evaluation(player, 20, concurrency=8)))
    assert all(ep.failed and ep.score is None for ep in episodes)
    # Fail-fast, counted: an episode ends only after both servers were quarantined (its two
    # attempts go to different servers), so only the 8 that started before can have tried a
    # server, and every later one fails without a connection attempt.
    attempts = sum(s["requests"] for s in policy.pool.snapshot())
    assert attempts <= 8 * 2
    fast = [ep for ep in episodes if "no healthy inference server" in ep.error]
    assert len(fast) >= 20 - 8 and all(dead[0] in ep.error and dead[1] in ep.error for ep in fast)


def test_a_hung_server_in_a_pool_costs_one_timeout_then_the_other_does_the_work(a, b, vocab_chat, solution):
    a.control(hang=True)
    policy = make([a.url, b.url], vocab_chat, retries=2, timeout=0.5, quarantine_after=1, quarantine_s=60)
    player = Player(policy, vocab_chat, solution)

    episodes = run(closing(policy, run_evaluation(player, 32, concurrency=16)))
    assert not any(ep.failed for ep in episodes), [ep.error for ep in episodes if ep.failed][:3]
    # Counted: only requests already under way when the first one timed out went to the hung
    # server (at most one per episode in flight); after that it got none.
    assert completions(a) <= 16
    snap = {s["url"]: s for s in policy.pool.snapshot()}
    assert not snap[a.url]["healthy"] and "timed out" in snap[a.url]["last_error"]


# -- episodes and groups under faults ------------------------------------------------


def test_a_malformed_shared_first_turn_falls_back_to_single_requests(a, vocab_chat, solution):
    a.control(malformed=True, fail_times=1)
    policy = make([a.url], vocab_chat)
    result = run(closing(policy, play_group(Player(policy, vocab_chat, solution), 3, GroupConfig(group_size=8))))
    assert result.group is not None and len(result.group.tokens) == 8


def test_failed_episodes_are_reported_failed_and_never_poison_a_group(a, vocab_chat, solution):
    a.control(status=500)
    policy = make([a.url], vocab_chat, retries=1, quarantine_after=100)
    player = Player(policy, vocab_chat, solution)
    result = run(closing(policy, play_group(player, 9, GroupConfig(group_size=4))))
    assert result.group is None and result.dropped == "failed_episodes"
    assert all(ep.failed and ep.score is None and ep.outcome is None and "HTTP 500" in ep.error
               for ep in result.episodes)


def test_a_server_that_dies_mid_run(config, vocab_chat, solution):
    """Two servers, one killed by PID while groups are in flight: the run finishes, every
    episode is either played or reported failed, and no emitted group holds a failure."""
    victim, survivor = MockServer(config), MockServer(config)
    try:
        victim.control(latency_ms=20)
        survivor.control(latency_ms=20)
        policy = make([victim.url, survivor.url], vocab_chat, retries=2, quarantine_after=2, quarantine_s=60)
        player = Player(policy, vocab_chat, solution)

        async def main():
            limiter = asyncio.Semaphore(16)
            tasks = [asyncio.create_task(play_group(player, seed, GroupConfig(group_size=8), limiter=limiter)) for seed in range(24)]
            await asyncio.sleep(0.3)
            victim.kill()
            return await asyncio.gather(*tasks)

        results = run(closing(policy, main()), limit=90)
    finally:
        victim.kill()
        survivor.kill()
    assert len(results) == 24
    for r in results:
        failed = [ep for ep in r.episodes if ep.failed]
        assert all(ep.error and ep.score is None for ep in failed)
        assert (r.group is None) == bool(failed)
        if r.group is not None:
            assert len(r.group.tokens) == 8 and None not in r.group.scores
    assert sum(r.group is not None for r in results) >= 20  # the survivor took over
    snap = {s["url"]: s for s in policy.pool.snapshot()}
    # the survivor stays healthy; whether the victim is already quarantined depends on
    # how many requests reached it after it died, which is timing
    assert snap[survivor.url]["healthy"]
    assert snap[victim.url]["requests"] > 0  # it served before it died


def test_the_only_server_dies_mid_run(config, vocab_chat, solution):
    server = MockServer(config)
    try:
        server.control(latency_ms=20)
        policy = make([server.url], vocab_chat, retries=1, quarantine_after=2, quarantine_s=60)
        player = Player(policy, vocab_chat, solution)

        done = []

        def on_episode(ep):
            done.append(ep)
            if len(done) == 20:  # killed on an event, not after a sleep: the same on any machine
                server.kill()

        episodes = run(closing(policy, run_evaluation(player, 200, concurrency=16, on_episode=on_episode)), limit=60)
    finally:
        server.kill()
    # The run ended; every episode is either a game or a failure with its error; a failure
    # carries no score, outcome or reward, and a game carries no error.
    assert len(episodes) == 200 and [ep.seed for ep in episodes] == list(eval_seeds(200))
    for ep in episodes:
        if ep.failed:
            assert ep.error and ep.score is None and ep.outcome is None and ep.reward is None
        else:
            assert ep.status in ("finished", "invalid", "truncated") and ep.error is None and ep.score is not None
    # 20 episodes were played before the kill and at most 16 were under way at it; every
    # episode that started later had no server to play on.
    assert all(not ep.failed for ep in done[:20])
    assert sum(ep.failed for ep in episodes) >= 200 - 20 - 16
    assert "no healthy inference server" in episodes[-1].error


def test_connections_are_kept_alive_reused_and_never_exceed_the_cap(a, vocab_chat):
    a.control(latency_ms=10)
    policy = make([a.url], vocab_chat, max_concurrency=8)
    (server,) = policy.pool._servers
    connection_pool = server.client._transport._pool
    assert type(connection_pool).__name__ == "_LinearConnectionPool"  # the linear-time assignment is in use

    async def main():
        sizes = []
        for _ in range(4):
            await asyncio.gather(*(policy.respond(TURN) for _ in range(32)))
            sizes.append(len(connection_pool.connections))
        return sizes

    sizes = run(closing(policy, main()))
    assert max(sizes) <= 8 and sizes[-1] == sizes[1]  # bounded, and the same connections serve every burst
    assert completions(a) == 128 and a.stats()["max_in_flight"] <= 8


def test_a_cancelled_wait_for_a_slot_stays_cancelled():
    """Ctrl-C cancels the run's task while it waits for a slot. If the slot frees in the same turn
    of the loop, the task must still end cancelled: taking the slot instead would swallow the
    interrupt, and the run would go on to finish as if never stopped."""

    async def main():
        pool = ServerPool([ServerSpec("http://127.0.0.1:9", max_concurrency=1)], timeout=10.0)
        try:
            holder = await pool._acquire(())
            waiting = asyncio.create_task(pool._acquire(()))
            for _ in range(3):
                await asyncio.sleep(0)  # the second caller is now parked on its waiter
            assert pool._waiters and not waiting.done()
            pool._release(holder)  # the slot frees ...
            waiting.cancel()  # ... and the interrupt lands before the waiter runs again
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert pool._servers[0].in_flight == 0  # the slot was not taken by the cancelled caller
        finally:
            await pool.aclose()

    asyncio.run(main())
