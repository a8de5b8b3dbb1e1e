"""A worker that dies without a word stops holding its min_batch_allocation share within the lease.

End to end: the API as a subprocess with its default `--env-lease`, real `blackjack-rl serve`
workers (the optimal bot: no model), SIGKILL by PID, a trainer pulling batches. Waits are
counted in the trainer's polls at a fixed interval, never read off a clock: a poll answered
without a batch is followed by a sleep of POLL_S, so N such polls took at least N x POLL_S,
and a slow machine makes fewer polls in the same time, never more.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from api_payloads import ATROPOS_REGISTRATION, make_group
from blackjack_rl.api.client import Batch, TrainerClient
from blackjack_rl.api.settings import ApiConfig
from helpers import ServerProcess, kill_process, poll_until, popen_cli, stop_process
from test_serve import Pulled, group_key, metrics_rows

POLL_S = 0.2  # the trainer's poll interval
WORKER_POLL_S = 1.0  # `blackjack-rl serve` asks /status-env once a second (--poll-interval)
BATCH = 8  # sequences per batch: a group of 4 from the owed worker, and 4 more


def _serve(api_url: str, out: Path, worker_id: str, *extra: str) -> subprocess.Popen[str]:
    return popen_cli("serve", "--policy", "optimal", "--group-size", "4", "--api-url", api_url, "--out", str(out),
                     "--quiet", "--worker-id", worker_id, "--seed", "5", "--max-batches-offpolicy", "1", *extra)


def _rows(out: Path, kind: str) -> list[dict[str, Any]]:
    path = out / "serve_metrics.jsonl"
    return [r for r in metrics_rows(out) if r["kind"] == kind] if path.exists() else []


def _env_id(out: Path, proc: subprocess.Popen[str]) -> int:
    def registered() -> list[dict[str, Any]]:
        assert proc.poll() is None, proc.communicate()[0]
        return _rows(out, "registered")

    return int(poll_until(registered, attempts=600, what=f"{out.name} registered")[-1]["env_id"])


def _take(seen: Pulled, batch: Batch) -> bool:
    """Keep a batch's groups once (a batch sent again has the same id); whether it was new."""
    if batch.batch_id in seen.batch_ids:
        return False
    seen.batch_ids.add(batch.batch_id)
    seen.extend(batch.groups)
    return True


def _pull_batches(trainer: TrainerClient, seen: Pulled, n: int, *, attempts: int) -> list[Batch]:
    batches: list[Batch] = []
    for _ in range(attempts):
        if len(batches) >= n:
            break
        batch = trainer.get_batch()
        if batch is None:
            time.sleep(POLL_S)
        elif _take(seen, batch):
            batches.append(batch)
    assert len(batches) >= n, f"{len(batches)} of {n} batches in {attempts} polls"
    return batches


def test_a_killed_worker_releases_its_share_within_the_lease(tmp_path: Path) -> None:
    """SIGKILL a worker owed half of every batch, start another: batches flow again within the lease.

    While the dead worker is still owed its share, every batch must hold one of its groups,
    so the first batch without one is the moment its share was released. That must come
    within the lease of its last poll: at most lease / POLL_S polls without a batch, plus one
    worker poll interval for a live worker to have groups queued again. (One run here: 14 polls;
    with the 120 s lease this API had before, 579.) Every group any worker posted reaches the
    trainer exactly once, the dead worker's included.
    """
    lease = ApiConfig.model_fields["env_lease_s"].default
    api = ServerProcess(tmp_path / "api.sqlite").start()  # its default --env-lease
    owed = ("--min-batch-allocation", "0.5")
    a = b = c = None
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": BATCH})
        assert trainer.get_batch() is None  # the trainer has started: workers may register
        a = _serve(api.url, tmp_path / "a", "a", *owed)
        env_a = _env_id(tmp_path / "a", a)
        b = _serve(api.url, tmp_path / "b", "b")
        env_b = _env_id(tmp_path / "b", b)
        seen = Pulled()

        # Alive, `a` polls far more often than its lease runs out: it holds its share in every batch.
        before = _pull_batches(trainer, seen, 6, attempts=1200)
        assert all(any(g["env_id"] == env_a for g in batch.groups) for batch in before)
        assert any(g["env_id"] == env_b for g in seen)

        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=30)
        c = _serve(api.url, tmp_path / "c", "c", *owed)  # its replacement: a new worker, owed half too

        bound = math.ceil((lease + WORKER_POLL_S) / POLL_S) + 2
        empty_polls = 0
        released = False
        for _ in range(bound + 20):  # each poll answered with a batch holds a group of the dead worker's
            batch = trainer.get_batch()
            if batch is None:
                empty_polls += 1
                assert empty_polls <= bound, f"no batch without the dead worker's groups in {empty_polls} polls"
                time.sleep(POLL_S)
                continue
            _take(seen, batch)
            if all(g["env_id"] != env_a for g in batch.groups):
                released = True
                break
        assert released, "the dead worker's groups kept coming"
        print(f"\npolls without a batch after SIGKILL: {empty_polls} (bound {bound}; lease {lease} s, "
              f"poll every {POLL_S} s)")

        # The replacement, once registered, is owed its own share, and gets it in every batch.
        env_c = _env_id(tmp_path / "c", c)
        after = _pull_batches(trainer, seen, 4, attempts=1200)
        assert all(any(g["env_id"] == env_c for g in batch.groups) for batch in after)

        # Stop the live workers (they drain and disconnect), then drain the queue.
        for proc in (b, c):
            out = stop_process(proc)
            assert proc.returncode == 0, out
        _drain(api.url, trainer, seen)

        keys = [group_key(g) for g in seen]
        assert len(set(keys)) == len(keys), "a group reached the trainer twice"
        received = {env: {g["episodes"][0]["seed"] for g in seen if g["env_id"] == env} for env in (env_a, env_b, env_c)}
        for out, env in ((tmp_path / "a", env_a), (tmp_path / "b", env_b), (tmp_path / "c", env_c)):
            posted = _rows(out, "group")
            assert posted and all(r["parked"] == 0 and r["rejected"] == 0 for r in posted)
            assert {r["seed"] for r in posted} <= received[env], f"{out.name}: a posted group never arrived"
        for out, env in ((tmp_path / "b", env_b), (tmp_path / "c", env_c)):
            assert len(received[env]) == _rows(out, "stopped")[-1]["sent"]
    finally:
        for proc in (a, b, c):
            kill_process(proc)
        api.kill()


def _drain(url: str, trainer: TrainerClient, seen: Pulled) -> None:
    """Pull what is queued; a last group of 4 short of a batch is completed with a filler group."""
    def queued() -> int:
        return int(httpx.get(f"{url}/status", timeout=10).json()["queue_size"])

    for _ in range(2):
        for _ in range(200):
            batch = trainer.get_batch()
            if batch is None:
                break
            _take(seen, batch)
        left = queued()
        if left == 0:
            break
        assert left == 1, f"{left} groups left with no worker owed a share"
        filler = make_group(n=4, env_id=None, uid="filler")
        filler["episodes"] = [{"seed": -1, "uid": "filler"} for _ in range(4)]
        assert httpx.post(f"{url}/scored_data", json=filler, timeout=10).status_code == 200
    assert queued() == 0
    seen[:] = [g for g in seen if g["env_id"] is not None]  # the filler is no worker's
