"""`evaluate` and `process` with --ray on a two-node Ray cluster on 127.0.0.1: the same bytes as a local run.

Every comparison is against the same command run locally (no Ray) on the same seeds;
only the timing fields of metrics.json may differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import poll_until, popen_cli, run_cli
from ray_cluster import NODE, ray
from blackjack_rl.cli import main
from mock_openai_server import MockServer, blackjack_answers, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # a Ray cluster per session
TIMING = ("seconds", "episodes_per_second")


def metrics(out: Path) -> dict:
    m = json.loads((out / "metrics.json").read_text())
    for key in TIMING:
        m.pop(key)
    return m


def assert_same_evaluation(local: Path, sharded: Path) -> None:
    assert metrics(local) == metrics(sharded)
    assert (local / "samples.jsonl").read_bytes() == (sharded / "samples.jsonl").read_bytes()


def test_sharded_evaluate_equals_the_local_run(ray_cluster, tmp_path):
    """The real command as its own driver (`--ray ADDRESS`), 4 actors on two nodes, many small shards."""
    common = ["evaluate", "--policy", "random", "--episodes", "700", "--concurrency", "8", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    run = run_cli(*common, "--out", str(tmp_path / "ray"), "--ray", ray_cluster.address, "--ray-cpus", "0.5")
    assert run.returncode == 0, run.stdout + run.stderr
    assert_same_evaluation(tmp_path / "local", tmp_path / "ray")
    assert metrics(tmp_path / "ray")["episodes"] == 700


def test_sharded_process_writes_the_same_groups_in_the_same_order(ray_cluster, tmp_path):
    common = ["process", "--policy", "optimal", "--groups", "40", "--group-size", "3", "--seed", "7", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray"), "--ray", ray_cluster.address, "--ray-actors", "2"]) == 0
    local = (tmp_path / "local" / "groups.jsonl").read_bytes()
    assert local == (tmp_path / "ray" / "groups.jsonl").read_bytes()
    assert len(local.splitlines()) == 40


@pytest.mark.embedded
@pytest.mark.slow
def test_the_embedded_model_sharded_equals_local(ray_cluster, tmp_path):
    """Each actor loads its own copy of the GGUF; sampling is seeded per turn, so the ids match."""
    common = ["evaluate", "--episodes", "6", "--constrained", "--max-tokens", "24", "--threads", "1",
              "--concurrency", "2", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray"), "--ray", ray_cluster.address, "--ray-actors", "2"]) == 0
    assert_same_evaluation(tmp_path / "local", tmp_path / "ray")


@pytest.fixture
def slow_server(tmp_path, vocab_chat):
    """The vLLM mock with latency, so a run lasts long enough to lose a node in the middle of it."""
    config = write_config(tmp_path / "answers.json", blackjack_answers(vocab_chat), vocab_chat.end_of_turn_ids[0])
    server = MockServer(config)
    server.control(latency_ms=25, record=False)
    yield server
    server.kill()


def test_a_node_removed_mid_run_loses_no_deal_and_counts_none_twice(ray_cluster, tmp_path, slow_server, gguf_path):
    """Three nodes, one actor each, playing through a shared server pool; the third node is
    removed (its raylet and workers killed) while its actor holds shards."""
    doomed = ray_cluster.add_node(**NODE)
    ray_cluster.wait_for_nodes()
    common = ["evaluate", "--policy", "openai", "--model", "mock", "--server", slow_server.url,
              "--token-path", "completions", "--tokenizer", str(gguf_path), "--max-tokens", "48",
              "--episodes", "480", "--concurrency", "4", "--quiet"]
    try:
        run = popen_cli(*common, "--out", str(tmp_path / "ray"), "--ray", ray_cluster.address)
        def answered_150() -> bool:
            assert run.poll() is None, run.stdout.read()
            return slow_server.stats()["requests"].get("/v1/completions", 0) >= 150

        poll_until(answered_150, attempts=600, interval_s=0.2, what="150 requests to the server")
        assert run.poll() is None, "the run ended before the node could be removed"
        ray_cluster.remove_node(doomed, allow_graceful=False)
        out, _ = run.communicate(timeout=240)
    finally:
        if doomed in ray_cluster.worker_nodes:
            ray_cluster.remove_node(doomed)
    assert run.returncode == 0, out
    assert "lost with its actor" in out  # a shard really was lost and played again
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert_same_evaluation(tmp_path / "local", tmp_path / "ray")
    assert metrics(tmp_path / "ray")["episodes_failed"] == 0


def test_actors_that_cannot_load_their_policy_stop_the_run_with_one_error(ray_cluster, tmp_path):
    """As when the model file is missing on the worker nodes: bounded retries, then the reason."""
    import asyncio

    from blackjack_rl.cluster import ClusterError
    from blackjack_rl.cluster.shards import Shards
    from blackjack_rl.config import load_settings

    settings = load_settings(overrides={"policy": {"model_path": str(tmp_path / "missing.gguf")},
                                        "out": str(tmp_path)})
    shards = Shards(ray, settings, actors=2)
    with pytest.raises(ClusterError, match="Ray actors of this run died.*missing.gguf"):
        asyncio.run(asyncio.wait_for(shards.evaluate(10, lambda k: None), 240))
