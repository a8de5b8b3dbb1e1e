"""`serve --ray --workers 2` on a two-node Ray cluster, feeding a real API process and a trainer.

One worker actor is killed mid-run; the command restarts it under the same worker id.
At the API: no group twice, no deal twice, and every group a worker logged as delivered
arrives. One SIGTERM to the command drains every worker.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from ray_cluster import ray
from blackjack_rl.api.client import TrainerClient
from blackjack_rl.cluster.workers import actor_name
from api_payloads import ATROPOS_REGISTRATION
from helpers import CLI, ServerProcess, cli_env, free_port, popen_cli
from test_serve import Pulled, group_key, pull

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # Ray clusters


def rows(out: Path) -> list[dict]:
    path = out / "serve_metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_seeds(out: Path) -> list[int]:
    return [r["seed"] for r in rows(out) if r["kind"] == "group"]


def keep_pulling_until(trainer: TrainerClient, seen: Pulled, condition, rounds: int) -> bool:
    """Pull batches (so the workers have room to send) until `condition()` holds, asked once per
    round of up to 20 pulls; bounded by the count of rounds."""
    for _ in range(rounds):
        if condition():
            return True
        pull(trainer, len(seen) + 1, seen, attempts=20)
    return condition()


def test_serve_actors_survive_a_killed_actor_with_no_group_lost_or_duplicated(ray_cluster, tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    out = tmp_path / "workers"
    run = None
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        run = popen_cli("serve", "--ray", ray_cluster.address, "--workers", "2", "--worker-id", "w",
                        "--policy", "random", "--group-size", "4", "--seed", "3", "--api-url", api.url,
                        "--out", str(out), "--max-batches-offpolicy", "2", "--steps-per-eval", "0", "--quiet")
        seen = Pulled()
        both_sent = keep_pulling_until(
            trainer, seen, lambda: all(len(logged_seeds(out / w)) >= 2 for w in ("w-0", "w-1")), rounds=90)
        assert both_sent, f"workers did not both send: {[rows(out / w)[-3:] for w in ('w-0', 'w-1')]}"
        assert run.poll() is None

        sent_before_kill = len(logged_seeds(out / "w-0"))
        ray.kill(ray.get_actor(actor_name("w-0")), no_restart=True)  # as if its process or node died
        restarted = keep_pulling_until(
            trainer, seen,
            lambda: sum(r["kind"] == "registered" for r in rows(out / "w-0")) >= 2
            and len(logged_seeds(out / "w-0")) >= sent_before_kill + 2, rounds=90)
        assert restarted, rows(out / "w-0")[-5:]

        run.send_signal(signal.SIGTERM)  # one signal drains every worker
        output, _ = run.communicate(timeout=180)
        assert run.returncode == 0, output
        assert "(1 restarts)" in output
        # the restarted worker took over its registration instead of leaving a second one behind
        registrations = [r["env_id"] for r in rows(out / "w-0") if r["kind"] == "registered"]
        assert len(registrations) == 2 and len(set(registrations)) == 1, registrations
        assert {r["env_id"] for r in rows(out / "w-1") if r["kind"] == "registered"}.isdisjoint(registrations)
        for w in ("w-0", "w-1"):
            assert rows(out / w)[-1]["kind"] == "stopped", rows(out / w)[-3:]
            assert rows(out / w)[-1]["parked"] == 0

        logged = logged_seeds(out / "w-0") + logged_seeds(out / "w-1")
        pull(trainer, len(logged), seen)
        assert trainer.get_batch() is None  # nothing else is queued
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        api.kill()

    keys = [group_key(g) for g in seen]
    assert len(set(keys)) == len(keys), "a group arrived twice"
    api_seeds = [g["episodes"][0]["seed"] for g in seen]
    assert len(set(api_seeds)) == len(api_seeds), "a deal was played twice (the restarted worker repeated its stream)"
    assert set(logged) <= set(api_seeds), "a group a worker delivered is missing at the API"
    # at most the one group whose post landed as the actor died is at the API without a log row
    assert len(set(api_seeds) - set(logged)) <= 1


def test_a_worker_that_fails_by_itself_is_one_line_and_not_restarted(ray_cluster, tmp_path):
    """A worker that raises (here: no API to register with) is a failure to report, not a death to retry."""
    run = popen_cli("serve", "--ray", ray_cluster.address, "--workers", "1", "--worker-id", "lonely",
                    "--policy", "random", "--api-url", f"http://127.0.0.1:{free_port()}", "--register-timeout", "1",
                    "--out", str(tmp_path / "w"), "--quiet")
    output, _ = run.communicate(timeout=180)
    assert run.returncode == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "worker lonely-0 failed" in errors[0], output
    assert "Traceback" not in output and "restarting" not in output


def test_ctrl_c_drains_every_worker_of_a_local_ray_instance(tmp_path):
    """`serve --ray` with no address starts Ray for itself; Ctrl-C reaches the whole process group
    (the command, Ray's own processes, the workers) and every worker still drains."""
    import os
    import subprocess

    api = ServerProcess(tmp_path / "api.sqlite").start()
    out = tmp_path / "workers"
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        run = subprocess.Popen([*CLI, "serve", "--ray", "--workers", "2",
                                "--worker-id", "c", "--policy", "random", "--group-size", "4", "--api-url", api.url,
                                "--out", str(out), "--steps-per-eval", "0", "--quiet"],
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        try:
            seen = Pulled()
            assert keep_pulling_until(trainer, seen, lambda: all(logged_seeds(out / w) for w in ("c-0", "c-1")), rounds=90)
            os.killpg(run.pid, signal.SIGINT)
            output, _ = run.communicate(timeout=180)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(timeout=30)
    finally:
        api.kill()
    assert run.returncode == 0, output
    assert "2 workers (0 restarts)" in output
    for w in ("c-0", "c-1"):
        assert rows(out / w)[-1]["kind"] == "stopped", rows(out / w)[-3:]
