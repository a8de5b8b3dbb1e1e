"""`blackjack-rl serve` against a real API process and a trainer that pulls batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blackjack_rl.api.client import TrainerClient
from conftest_api import ATROPOS_REGISTRATION, ServerProcess

SRC = Path(__file__).resolve().parents[1] / "src"


def start_serve(api_url: str, out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "blackjack_rl.cli", "serve", "--policy", "random", "--group-size", "4",
           "--api-url", api_url, "--out", str(out), "--quiet", "--worker-id", "w1", "--seed", "5", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Pulled(list):
    """Groups received by the trainer, and the ids of the batches they came in."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_ids: set[int] = set()


def pull(trainer: TrainerClient, want_groups: int, timeout_s: float, seen: Pulled) -> None:
    """Pull batches until `seen` holds want_groups groups; a batch counts once, by batch_id.

    A batch can be redelivered after an API restart even if its first delivery was lost
    on the way (the API was killed mid-response), so redelivery alone is no reason to skip.
    """
    ids = seen.batch_ids
    deadline = time.monotonic() + timeout_s
    while len(seen) < want_groups and time.monotonic() < deadline:
        try:
            batch = trainer.get_batch()
        except Exception:  # the API may be down on purpose; keep polling until the deadline
            time.sleep(0.2)
            continue
        if batch is None:
            time.sleep(0.1)
            continue
        if batch.batch_id not in ids:
            ids.add(batch.batch_id)
            seen.extend(batch.groups)


def group_key(group: dict) -> tuple:
    return (group["episodes"][0]["seed"], tuple(map(tuple, group["tokens"])))


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "serve_metrics.jsonl").read_text().splitlines()]


def test_serve_feeds_a_trainer(tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        serve = start_serve(api.url, tmp_path / "w", "--max-groups", "6")
        seen = Pulled()
        pull(trainer, 6, 60, seen)
        out, _ = serve.communicate(timeout=60)
        assert serve.returncode == 0, out
        assert len(seen) == 6 and len({group_key(g) for g in seen}) == 6
        for g in seen:
            assert len(g["tokens"]) == 4 and g["env_id"] is not None
            assert len({e["seed"] for e in g["episodes"]}) == 1
        rows = metrics_rows(tmp_path / "w")
        kinds = [r["kind"] for r in rows]
        assert kinds[0] == "registered" and kinds[-1] == "stopped" and kinds.count("group") == 6
        assert rows[-1]["sent"] == 6 and rows[-1]["parked"] == 0
    finally:
        api.kill()


def test_api_down_while_serving_loses_nothing(tmp_path):
    db = tmp_path / "api.sqlite"
    api = ServerProcess(db).start()
    serve = None
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        serve = start_serve(api.url, tmp_path / "w", "--max-groups", "12", "--max-batches-offpolicy", "2")
        seen = Pulled()
        pull(trainer, 2, 60, seen)
        assert len(seen) >= 2
        api.kill()  # kill -9: the worker must park finished groups in its outbox
        time.sleep(3)
        api = ServerProcess(db, port=api.port).start()  # same port, same database
        pull(trainer, 12, 120, seen)
        out, _ = serve.communicate(timeout=90)
        assert serve.returncode == 0, out
        assert len(seen) == 12, f"got {len(seen)} groups"
        assert len({group_key(g) for g in seen}) == 12  # each delivered exactly once
        assert metrics_rows(tmp_path / "w")[-1]["parked"] == 0
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
        api.kill()


def test_evaluates_as_the_trainer_steps_and_drains_on_sigterm(tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        serve = start_serve(api.url, tmp_path / "w", "--steps-per-eval", "1", "--eval-episodes", "20")
        seen = Pulled()
        pull(trainer, 4, 60, seen)  # two trainer steps
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(r["kind"] == "eval" for r in metrics_rows(tmp_path / "w")):
            time.sleep(0.2)
        evals = [r for r in metrics_rows(tmp_path / "w") if r["kind"] == "eval"]
        assert evals and evals[0]["episodes"] == 20 and evals[0]["step"] >= 1
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=60)
        assert serve.returncode == 0, out
        stopped = metrics_rows(tmp_path / "w")[-1]
        assert stopped["kind"] == "stopped" and stopped["parked"] == 0 and stopped["sent"] >= 2
        pull(trainer, stopped["sent"], 30, seen)
        assert len({group_key(g) for g in seen}) == stopped["sent"]
    finally:
        api.kill()


def test_serve_without_api_gives_a_clear_error(tmp_path):
    from conftest_api import free_port

    serve = start_serve(f"http://127.0.0.1:{free_port()}", tmp_path / "w", "--register-timeout", "2")
    out, _ = serve.communicate(timeout=120)
    assert serve.returncode == 2 and "error" in out
