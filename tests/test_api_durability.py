"""Real servers (`python -m blackjack_rl.api` on 127.0.0.1), killed with SIGKILL mid-run.

What must hold: every group the API acknowledged reaches the trainer in exactly one batch,
through crashes of the API, an API that is down while the environment plays (outbox), and
clients that speak exactly what atroposlib 0.4.0 speaks.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group, uids
from helpers import ServerProcess

from blackjack_rl.api import EnvClient, TrainerClient
from blackjack_rl.retry import RetryPolicy
from blackjack_rl.api.models import SCORED_DATA_FIELDS, RegisterEnv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.kill()


def launch(servers: list[ServerProcess], db: Path, **kwargs: Any) -> ServerProcess:
    server = ServerProcess(db, **kwargs)
    servers.append(server)
    return server.start()


def test_state_survives_kill_9(tmp_path: Path, servers: list[ServerProcess]) -> None:
    db = tmp_path / "api.sqlite"
    api = launch(servers, db)
    with TrainerClient(api.url) as trainer:
        trainer.register({**ATROPOS_REGISTRATION, "starting_step": 40})
        assert trainer.get_batch() is None
        env = httpx.post(f"{api.url}/register-env", json=atropos_register_env(4)).json()
        assert env["env_id"] == 0
        for i in range(5):
            assert httpx.post(f"{api.url}/scored_data", json=make_group(uid=f"u{i}")).status_code == 200
        first = trainer.get_batch()
        assert first is not None and uids(first.groups) == ["u0", "u1"] and first.step == 41

        api.kill()
        api = launch(servers, db, port=api.port)

        assert httpx.get(f"{api.url}/info").json() == {"batch_size": 8, "max_token_len": 512}
        assert httpx.get(f"{api.url}/status").json() == {"current_step": 41, "queue_size": 3}
        status = httpx.get(f"{api.url}/status-env", params={"env_id": 0}).json()
        assert status["self_queue_size"] == 3
        # The environment is still registered and the trainer has started: no waiting.
        assert httpx.post(f"{api.url}/register-env", json=atropos_register_env(4)).json()["env_id"] == 1
        # The batch in flight was acknowledged by nothing yet; a trainer restarted with the
        # client's explicit ack gets it again, then the rest in order.
        restarted = TrainerClient(api.url)
        again = restarted.get_batch()
        assert again is not None and (again.batch_id, again.redelivered) == (first.batch_id, True)
        assert again.groups == first.groups
        nxt = restarted.get_batch()
        assert nxt is not None and uids(nxt.groups) == ["u2", "u3"] and nxt.step == 42
        restarted.close()


def test_kill_9_mid_run_delivers_every_acknowledged_group_exactly_once(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    db = tmp_path / "api.sqlite"
    api = launch(servers, db)
    port = api.port
    total = 48  # groups of 4, batches of 8
    received: dict[int, list[str]] = {}  # batch_id -> group uids
    sizes_ok: list[bool] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    parked: list[int] = []

    def trainer_loop() -> None:
        try:
            patient = RetryPolicy(attempts=40, base_delay_s=0.05, max_delay_s=0.5)
            with TrainerClient(f"http://127.0.0.1:{port}", retry=patient, timeout_s=10) as trainer:
                trainer.register(ATROPOS_REGISTRATION)
                for _ in range(3000):  # a bounded count of polls
                    if stop.is_set():
                        return
                    batch = trainer.get_batch()
                    if batch is None:
                        time.sleep(0.02)
                        continue
                    got = uids(batch.groups)
                    if batch.batch_id in received:
                        assert received[batch.batch_id] == got, "a resent batch must be the same batch"
                    received[batch.batch_id] = got
                    sizes_ok.append(batch.sequences == 8)
                    if sum(len(v) for v in received.values()) >= total:
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    trainer = threading.Thread(target=trainer_loop, daemon=True)
    trainer.start()

    async def environment() -> None:
        quick = RetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.2, max_elapsed_s=1.0)
        async with EnvClient(api.url, outbox=tmp_path / "outbox.sqlite", park_after=quick, timeout_s=5) as env:
            await env.register_env(RegisterEnv(**atropos_register_env(4)), poll_interval_s=0.05, timeout_s=20)
            for i in range(total):
                if i == total // 3:
                    api.kill()  # SIGKILL with groups queued, a batch in flight and posts arriving
                if i == total // 2:
                    launch(servers, db, port=port)
                result = await env.submit([make_group(uid=f"g{i:03d}")])
                parked.append(result.parked_groups)
                await asyncio.sleep(0.01)
            for _ in range(300):
                if env.outbox is None or not env.outbox.pending_posts():
                    break
                await env.flush_outbox(quick)
                await asyncio.sleep(0.1)
            assert env.outbox is not None and env.outbox.pending_posts() == 0
            assert env.outbox.rejected() == []

    asyncio.run(environment())
    trainer.join(timeout=60)
    stop.set()
    assert not errors, errors
    delivered = [u for batch in received.values() for u in batch]
    assert sorted(delivered) == [f"g{i:03d}" for i in range(total)]  # all, and each exactly once
    assert all(sizes_ok)
    assert max(parked) > 0  # the API really was down while the environment played


def _pool_workers(pid: int) -> set[int]:
    """PIDs of `pid`'s multiprocessing workers (Linux /proc), not its resource tracker."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid and b"multiprocessing.spawn" in command:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ingest_workers_end_when_the_server_is_killed(tmp_path: Path, servers: list[ServerProcess]) -> None:
    """A SIGKILLed server cannot stop its worker processes: they must notice and end themselves,
    not wait forever for work (a restarted server starts its own)."""
    api = launch(servers, tmp_path / "api.sqlite", args=["--ingest-workers", "2"])
    assert api.proc is not None
    with TrainerClient(api.url) as trainer:
        trainer.register(ATROPOS_REGISTRATION)
        trainer.get_batch()
        httpx.post(f"{api.url}/register-env", json=atropos_register_env(4)).raise_for_status()
        for i in range(4):  # checked by the workers
            assert httpx.post(f"{api.url}/scored_data", json=make_group(uid=f"w{i}")).status_code == 200
    workers = _pool_workers(api.proc.pid)
    assert len(workers) == 2
    api.kill()
    deadline = time.monotonic() + 60
    while (alive := {p for p in workers if Path(f"/proc/{p}").exists() and _state(p) != "Z"}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"worker processes {sorted(alive)} outlived the killed server"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def test_outbox_flushes_in_order_when_the_api_returns(tmp_path: Path, servers: list[ServerProcess]) -> None:
    db = tmp_path / "api.sqlite"
    api = launch(servers, db)
    with TrainerClient(api.url) as trainer:
        trainer.register(ATROPOS_REGISTRATION)
        trainer.get_batch()

        async def park_then_flush() -> None:
            quick = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.05, max_elapsed_s=0.5)
            async with EnvClient(api.url, outbox=tmp_path / "outbox.sqlite", park_after=quick) as env:
                await env.register_env(RegisterEnv(**atropos_register_env(4)))
                api.kill()
                for i in range(6):
                    result = await env.submit([make_group(uid=f"p{i}")])
                    assert (result.sent_groups, result.parked_groups) == (0, i + 1)
                launch(servers, db, port=api.port)
                result = await env.flush_outbox()
                assert (result.sent_groups, result.parked_groups) == (6, 0)

        asyncio.run(park_then_flush())
        got = [uids(trainer.wait_for_batch(10).groups) for _ in range(3)]
        assert got == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]


def test_atroposlib_trainer_and_environment_unchanged(tmp_path: Path, servers: list[ServerProcess]) -> None:
    """Byte for byte what atroposlib 0.4.0 and its example trainer send, over real HTTP."""
    api = launch(servers, tmp_path / "api.sqlite")
    url = api.url
    with httpx.Client(base_url=url, timeout=10) as http:
        # Example trainer: register, then poll /batch (no ack parameter).
        assert isinstance(http.post("/register", json=ATROPOS_REGISTRATION).json()["uuid"], int)
        # BaseEnv.register_env polls while the status is not "success".
        assert http.post("/register-env", json=atropos_register_env(4)).json()["status"] == "wait for trainer to start"
        assert http.get("/batch").json() == {"batch": None}
        reg = http.post("/register-env", json=atropos_register_env(4)).json()
        assert {"status", "env_id", "wandb_name", "starting_step", "checkpoint_dir", "checkpoint_interval",
                "num_steps"} <= set(reg)
        env_id = reg["env_id"]
        assert http.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
        # BaseEnv.get_status: GET with a JSON body.
        status = http.request("GET", "/status-env", json={"env_id": env_id}).json()
        assert {"current_step", "queue_size", "unallocated_fraction", "self_queue_size", "max_group_size",
                "env_weight"} <= set(status)

        def atropos_group(uid: str) -> dict[str, Any]:
            group = make_group(uid=uid)
            del group["inference_logprobs"], group["episodes"]
            group["messages"] = [[{"role": "user", "content": uid}] for _ in range(4)]
            # handle_send_to_api's setdefaults, then env_id.
            group.update(distill_token_ids=None, distill_logprobs=None, env_id=env_id)
            return group

        def post_like_atropos(path: str, payload: Any) -> httpx.Response:
            # BaseEnv._post_json_with_compression: gzip when >= 1024 bytes and smaller.
            raw = json.dumps(payload).encode("utf-8")
            headers = {"Content-Type": "application/json"}
            body = raw
            if len(raw) >= 1024 and len(compressed := gzip.compress(raw)) < len(raw):
                headers["Content-Encoding"] = "gzip"
                body = compressed
            return http.post(path, content=body, headers=headers)

        assert post_like_atropos("/scored_data", atropos_group("single")).json() == {"status": "received"}
        listed = post_like_atropos("/scored_data_list", [atropos_group("l0"), atropos_group("l1"), atropos_group("l2")])
        assert listed.json() == {"status": "received", "groups_processed": 3}
        assert http.get("/status").json() == {"current_step": 0, "queue_size": 4}

        batches = []
        while (data := http.get("/batch").json())["batch"] is not None:
            batches.append(data["batch"])
        assert len(batches) == 2
        for batch in batches:
            assert sum(len(item["tokens"]) for item in batch) == 8
            for item in batch:
                assert set(SCORED_DATA_FIELDS) <= set(item)
                assert item["inference_logprobs"] is None and item["messages"][0][0]["role"] == "user"
        assert [b[0]["messages"][0][0]["content"] for b in batches] == ["single", "l1"]
        assert http.post("/disconnect-env", json={"env_id": env_id}).json() == {"status": "success"}
        assert http.get("/reset_data").status_code == 403  # no token configured


def test_token_from_the_environment_variable(tmp_path: Path, servers: list[ServerProcess]) -> None:
    api = launch(servers, tmp_path / "api.sqlite", env={"BLACKJACK_RL_API_TOKEN": "tok"}, token="tok")
    assert httpx.get(f"{api.url}/status").status_code == 401
    with TrainerClient(api.url, token="tok") as trainer:
        trainer.register(ATROPOS_REGISTRATION)
        assert trainer.info()["batch_size"] == 8
        assert httpx.post(f"{api.url}/reset_data", headers={"Authorization": "Bearer tok"}).status_code == 200
