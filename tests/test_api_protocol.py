"""The Atropos protocol, in-process: registration, batches, acknowledgement, status, access control."""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group, uids
from fastapi.testclient import TestClient
from helpers import cli_env

from blackjack_rl.api import ApiConfig, ApiRejected, EnvClient, create_app
from blackjack_rl.retry import RetryPolicy
from blackjack_rl.api.models import SCORED_DATA_FIELDS, RegisterEnv


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))) as c:
        yield c


def start(c: TestClient, batch_size: int = 8, **reg: Any) -> None:
    assert c.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": batch_size, **reg}).status_code == 200
    assert c.get("/batch").json()["batch"] is None


def register_env(c: TestClient, group_size: int = 4, **changes: Any) -> int:
    body = c.post("/register-env", json=atropos_register_env(group_size, **changes)).json()
    assert body["status"] == "success", body
    return int(body["env_id"])


def drain(c: TestClient) -> list[dict[str, Any]]:
    batches = []
    while (b := c.get("/batch").json())["batch"] is not None:
        batches.append(b)
    return batches


def test_environments_wait_for_the_trainers_first_batch_request(client: TestClient) -> None:
    assert client.post("/register-env", json=atropos_register_env()).json() == {"status": "wait for trainer to start"}
    assert client.post("/register", json=ATROPOS_REGISTRATION).json()["uuid"] > 0
    assert client.post("/register-env", json=atropos_register_env()).json()["status"] == "wait for trainer to start"
    assert client.get("/batch").json() == {"batch": None}
    answer = client.post("/register-env", json=atropos_register_env()).json()
    assert answer == {
        "status": "success",
        "env_id": 0,
        "wandb_name": "blackjack_0",
        "checkpoint_dir": "checkpoints",
        "starting_step": 0,
        "checkpoint_interval": 10,
        "num_steps": 100,
    }
    assert client.post("/register-env", json=atropos_register_env()).json()["wandb_name"] == "blackjack_1"


def test_batch_before_registration_explains_itself(client: TestClient) -> None:
    body = client.get("/batch").json()
    assert body["batch"] == [] and "Call /register first" in body["message"]
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert client.get("/wandb_info").json() == {"group": None, "project": None}
    assert client.get("/status").json() == {"current_step": 0, "queue_size": 0}
    r = client.post("/scored_data", json=make_group(env_id=None))
    assert r.status_code == 503 and "no trainer has registered" in r.json()["detail"]


def test_first_registration_fixes_the_run(client: TestClient) -> None:
    start(client, batch_size=8, wandb_group="g", wandb_project="p", starting_step=5)
    other = client.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": 64}).json()["uuid"]
    assert other > 0
    assert client.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
    assert client.get("/wandb_info").json() == {"group": "g", "project": "p"}
    assert client.get("/status").json()["current_step"] == 5


def test_every_atropos_field_and_every_extra_key_reaches_the_trainer(client: TestClient) -> None:
    start(client)
    register_env(client)
    plain = make_group(uid="plain")
    client.post("/scored_data", json=plain)  # identity, one group
    gz = make_group(uid="gz")
    client.post("/scored_data_list", content=gzip.compress(json.dumps([gz]).encode()),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    two = [make_group(uid="l1"), {**make_group(uid="l2"), "custom": {"nested": [1, 2]}}]
    client.post("/scored_data_list", content=gzip.compress(json.dumps(two).encode()),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    groups = [g for b in drain(client) for g in b["batch"]]
    assert uids(groups) == ["plain", "gz", "l1", "l2"]
    for g in groups:
        assert set(SCORED_DATA_FIELDS) <= set(g)
        assert g["episodes"][0]["outcome"] == "win" and g["env_id"] == 0
        assert g["distill_token_ids"] is None and g["generation_params"] is None
        assert g["advantages"] == [] and g["group_overrides"] == {}
        assert g["tokens"] == plain["tokens"] and g["inference_logprobs"] == plain["inference_logprobs"]
    assert groups[3]["custom"] == {"nested": [1, 2]}


def test_extra_keys_holding_nan_become_null(client: TestClient) -> None:
    start(client, batch_size=4)
    register_env(client)
    body = json.dumps(make_group()).replace('"outcome": "win"', '"outcome": NaN', 1)
    assert client.post("/scored_data", content=body, headers={"Content-Type": "application/json"}).status_code == 200
    batch = client.get("/batch")
    assert b"NaN" not in batch.content
    assert batch.json()["batch"][0]["episodes"][0]["outcome"] is None


def test_a_batch_is_kept_until_the_next_request_and_resent_after_a_trainer_restart(client: TestClient) -> None:
    start(client)
    register_env(client)
    for i in range(6):
        client.post("/scored_data", json=make_group(uid=f"u{i}"))
    first = client.get("/batch").json()
    assert (first["batch_id"], first["step"], first["redelivered"]) == (1, 1, False)
    assert uids(first["batch"]) == ["u0", "u1"]
    # The trainer crashes mid-step and comes back: registers, asks again, gets the same batch.
    client.post("/register", json=ATROPOS_REGISTRATION)
    again = client.get("/batch").json()
    assert (again["batch_id"], again["step"], again["redelivered"]) == (1, 1, True)
    assert again["batch"] == first["batch"]
    # Asking again acknowledges it.
    second = client.get("/batch").json()
    assert (second["batch_id"], second["step"], uids(second["batch"])) == (2, 2, ["u2", "u3"])
    assert client.get("/status").json() == {"current_step": 2, "queue_size": 2}


def test_explicit_ack_resends_a_batch_whose_response_was_lost(client: TestClient) -> None:
    start(client)
    register_env(client)
    for i in range(6):
        client.post("/scored_data", json=make_group(uid=f"u{i}"))
    got = client.get("/batch", params={"ack": 0}).json()
    assert got["batch_id"] == 1
    lost = client.get("/batch", params={"ack": 1}).json()  # acknowledges 1, forms 2 ... response lost
    assert lost["batch_id"] == 2
    retry = client.get("/batch", params={"ack": 1}).json()  # still acknowledging 1: 2 was not received
    assert (retry["batch_id"], retry["redelivered"], retry["batch"]) == (2, True, lost["batch"])
    nxt = client.get("/batch", params={"ack": 2}).json()
    assert (nxt["batch_id"], uids(nxt["batch"])) == (3, ["u4", "u5"])
    assert client.get("/batch", params={"ack": "x"}).status_code == 422


def test_heterogeneous_groups_pack_into_exact_batches(client: TestClient) -> None:
    start(client, batch_size=8)
    a = register_env(client, 4, desired_name="a")
    b = register_env(client, 2, desired_name="b")
    sizes = [(a, 4), (b, 2), (a, 4), (b, 2), (b, 2), (a, 4), (b, 2)]
    for i, (env, n) in enumerate(sizes):
        assert client.post("/scored_data", json=make_group(n=n, env_id=env, uid=f"u{i}")).status_code == 200
    batches = drain(client)
    # Shortest prefix that can fill a batch, older groups preferred within it.
    assert [uids(b["batch"]) for b in batches] == [["u0", "u2"], ["u1", "u3", "u5"]]
    assert all(sum(len(g["tokens"]) for g in b["batch"]) == 8 for b in batches)
    assert client.get("/status").json()["queue_size"] == 2


@pytest.fixture
def patient_client(tmp_path: Path) -> Iterator[TestClient]:
    """An app whose environments stay owed their share however slowly the test runs (the lease has its own tests)."""
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite", env_lease_s=3600))) as c:
        yield c


def test_min_batch_allocation_is_honoured(patient_client: TestClient) -> None:
    client = patient_client
    start(client, batch_size=8)
    big = register_env(client, 4, desired_name="big")
    small = register_env(client, 2, desired_name="small", min_batch_allocation=0.5)
    for i in range(4):
        client.post("/scored_data", json=make_group(n=4, env_id=big, uid=f"big{i}"))
    assert client.get("/batch").json()["batch"] is None  # "small" is owed half of every batch
    for i in range(2):
        client.post("/scored_data", json=make_group(n=2, env_id=small, uid=f"small{i}"))
    batch = client.get("/batch").json()["batch"]
    assert uids(batch) == ["big0", "small0", "small1"]
    status = client.get("/status-env", params={"env_id": big}).json()
    assert status["unallocated_fraction"] == 0.5


def test_status_env_counts_the_queue_as_run_api_holds_it(tmp_path: Path) -> None:
    """A group of another size than its environment's group_size is queued, and batched, at once; run-api
    holds it back until some such groups add up to group_size, and /status-env counts it as run-api does."""
    db = tmp_path / "api.sqlite"

    def status(c: TestClient, env: int) -> dict[str, Any]:
        answer = c.get("/status-env", params={"env_id": env}).json()
        return {k: answer[k] for k in ("max_group_size", "self_queue_size", "queue_size")}

    def post(c: TestClient, n: int, env: int | None, uid: str) -> None:
        assert c.post("/scored_data", json=make_group(n=n, env_id=env, uid=uid)).status_code == 200

    with TestClient(create_app(ApiConfig(db_path=db))) as c:
        start(c, batch_size=8)
        env = register_env(c, 4)
        post(c, 2, env, "two")  # 2 of 4 sequences survived
        assert status(c, env) == {"max_group_size": 1, "self_queue_size": 0, "queue_size": 0}
        assert c.get("/status").json()["queue_size"] == 1  # queued all the same
        post(c, 1, env, "one")
    with TestClient(create_app(ApiConfig(db_path=db))) as c:  # a restart keeps what run-api would hold
        assert status(c, env) == {"max_group_size": 1, "self_queue_size": 0, "queue_size": 0}
        post(c, 1, env, "one more")  # 2 + 1 + 1: run-api releases the three
        assert status(c, env) == {"max_group_size": 2, "self_queue_size": 1, "queue_size": 1}
        post(c, 4, env, "four")
        assert status(c, env) == {"max_group_size": 4, "self_queue_size": 2, "queue_size": 2}
        assert uids(c.get("/batch").json()["batch"]) == ["two", "one", "one more", "four"]
        # A held group that a batch takes is no longer held: the next 2 has nothing to add up with.
        post(c, 2, env, "held")
        post(c, 2, None, "no env")
        post(c, 4, None, "no env 4")
        assert uids(c.get("/batch").json()["batch"]) == ["held", "no env", "no env 4"]
        post(c, 2, env, "alone")
        assert status(c, env) == {"max_group_size": 1, "self_queue_size": 0, "queue_size": 0}


def test_status_env_of_groups_of_one_sequence(client: TestClient) -> None:
    """run-api's arithmetic: while every queued group has one sequence, other environments' count for nothing."""
    start(client, batch_size=4)
    a = register_env(client, 1, desired_name="a")
    b = register_env(client, 1, desired_name="b")
    for i in range(3):
        assert client.post("/scored_data", json=make_group(n=1, env_id=a, uid=f"a{i}")).status_code == 200
    assert client.get("/status-env", params={"env_id": b}).json()["queue_size"] == 0
    assert client.get("/status-env", params={"env_id": a}).json()["queue_size"] == 3


def test_status_env_by_query_or_json_body(client: TestClient) -> None:
    start(client, batch_size=8)
    a = register_env(client, 4, max_token_length=1000, weight=1.0)
    b = register_env(client, 4, max_token_length=1000, weight=3.0)
    for i in range(3):
        client.post("/scored_data", json=make_group(env_id=a, uid=f"a{i}"))
    client.post("/scored_data", json=make_group(env_id=b, uid="b0"))
    by_query = client.get("/status-env", params={"env_id": a}).json()
    by_body = client.request("GET", "/status-env", json={"env_id": a}).json()
    assert by_query == by_body
    assert by_query == {
        "current_step": 0,
        "queue_size": 4,
        "unallocated_fraction": 1.0,
        "self_queue_size": 3,
        "max_group_size": 4,
        "env_weight": 0.25,
    }
    assert client.get("/status-env", params={"env_id": b}).json()["env_weight"] == 0.75
    assert client.post("/disconnect-env", json={"env_id": b}).json() == {"status": "success"}
    assert client.get("/status-env", params={"env_id": a}).json()["env_weight"] == 1.0
    r = client.get("/status-env")
    assert r.status_code == 422 and "EnvIdentifier" in r.json()["detail"]


def test_latest_example(client: TestClient) -> None:
    assert client.get("/latest_example").json()["tokens"] == []
    start(client)
    register_env(client)
    client.post("/scored_data", json=make_group(uid="latest"))
    example = client.get("/latest_example").json()
    assert example["episodes"][0]["uid"] == "latest" and example["distill_logprobs"] is None


def test_idempotency_key_queues_a_retried_post_once(client: TestClient) -> None:
    start(client)
    register_env(client)
    headers = {"Idempotency-Key": "post-1"}
    first = client.post("/scored_data_list", json=[make_group(uid="once")], headers=headers)
    again = client.post("/scored_data_list", json=[make_group(uid="once")], headers=headers)
    assert first.json() == again.json() == {"status": "received", "groups_processed": 1}
    assert client.get("/status").json()["queue_size"] == 1


def test_backpressure_answers_503_with_retry_after_and_recovers(tmp_path: Path) -> None:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", max_queued_sequences=16))) as c:
        start(c)
        register_env(c)
        r = c.post("/scored_data_list", json=[make_group(uid=str(i)) for i in range(5)])
        assert r.status_code == 413 and "more than the queue may ever hold" in r.json()["detail"]
        for i in range(4):
            assert c.post("/scored_data", json=make_group(uid=f"u{i}")).status_code == 200
        full = c.post("/scored_data", json=make_group(uid="late"))
        assert full.status_code == 503 and full.headers["Retry-After"] == "2"
        assert "queue is full" in full.json()["detail"]
        assert c.get("/batch").json()["batch"] is not None
        assert c.get("/batch").json()["batch"] is not None  # acknowledges the first batch
        assert c.post("/scored_data", json=make_group(uid="late")).status_code == 200


def test_token_guards_every_endpoint(tmp_path: Path) -> None:
    app = create_app(ApiConfig(db_path=tmp_path / "a.sqlite", token="s3cret"))
    with TestClient(app) as anon:
        for method, path in [("GET", "/"), ("GET", "/status"), ("GET", "/batch"), ("POST", "/register"),
                             ("POST", "/register-env"), ("POST", "/scored_data"), ("POST", "/scored_data_list"),
                             ("GET", "/status-env"), ("GET", "/info"), ("GET", "/wandb_info"),
                             ("POST", "/disconnect-env"), ("GET", "/latest_example"), ("GET", "/reset_data"),
                             ("POST", "/reset_data"), ("GET", "/openapi.json")]:
            r = anon.request(method, path)
            assert r.status_code == 401, (method, path)
            assert r.headers["WWW-Authenticate"] == "Bearer"
        assert anon.get("/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert anon.post("/register", json=ATROPOS_REGISTRATION, headers=auth).status_code == 200
        assert anon.get("/info", headers=auth).json()["batch_size"] == 8
        assert anon.get("/reset_data", headers=auth).text == "Reset successful"
        assert anon.get("/info", headers=auth).json()["batch_size"] == -1
        assert anon.post("/reset_data", headers=auth).status_code == 200


def test_reset_is_refused_without_a_configured_token(client: TestClient) -> None:
    start(client)
    for method in ("GET", "POST"):
        r = client.request(method, "/reset_data")
        assert r.status_code == 403 and "token" in r.json()["detail"]
    assert client.get("/info").json()["batch_size"] == 8


def test_cors_is_off_by_default_and_opt_in(tmp_path: Path) -> None:
    origin = {"Origin": "https://dash.example"}
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite"))) as c:
        assert "access-control-allow-origin" not in c.get("/status", headers=origin).headers
    cfg = ApiConfig(db_path=tmp_path / "b.sqlite", token="t", cors_origins=["https://dash.example"])
    with TestClient(create_app(cfg)) as c:
        pre = c.options("/status", headers={**origin, "Access-Control-Request-Method": "GET",
                                            "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://dash.example"
        r = c.get("/status", headers={**origin, "Authorization": "Bearer t"})
        assert r.headers["access-control-allow-origin"] == "https://dash.example"
        other = c.get("/status", headers={"Origin": "https://evil.example", "Authorization": "Bearer t"})
        assert "access-control-allow-origin" not in other.headers


def test_a_second_server_on_the_same_database_is_refused(tmp_path: Path) -> None:
    cfg = ApiConfig(db_path=tmp_path / "a.sqlite")
    with TestClient(create_app(cfg)):
        with pytest.raises(OSError, match="another trajectory API process"):
            with TestClient(create_app(cfg)):
                pass


# --- the async environment client, against the app in-process ------------------------------


async def _with_app(tmp_path: Path, config: dict[str, Any], body: Any) -> None:
    app = create_app(ApiConfig(db_path=tmp_path / "api.sqlite", **config))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as trainer:
            await body(transport, trainer)


class _CountingTransport(httpx.AsyncBaseTransport):
    """Counts the requests a client really sends, so a test asserts "not retried" by count."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await self.inner.handle_async_request(request)


def test_env_client_waits_for_the_trainer_then_honours_retry_after(tmp_path: Path) -> None:
    async def body(transport: httpx.AsyncBaseTransport, trainer: httpx.AsyncClient) -> None:
        fast = RetryPolicy(attempts=20, base_delay_s=0.01, max_delay_s=0.05)
        counting = _CountingTransport(transport)
        async with EnvClient("http://api", transport=counting, retry=fast) as env:
            registering = asyncio.create_task(env.register_env(RegisterEnv(**atropos_register_env(4)),
                                                               poll_interval_s=0.02, timeout_s=5))
            await asyncio.sleep(0.1)
            assert not registering.done()  # waiting for the trainer
            await trainer.post("/register", json=ATROPOS_REGISTRATION)
            await trainer.get("/batch")
            assert (await registering).env_id == 0
            await env.send_groups([make_group(uid=str(i), env_id=None) for i in range(4)])  # fills the cap
            assert (await env.status_env()).self_queue_size == 4

            async def drain_later() -> None:
                await asyncio.sleep(0.5)
                await trainer.get("/batch")
                await trainer.get("/batch")

            drainer = asyncio.create_task(drain_later())
            t0 = time.monotonic()
            assert (await env.send_groups([make_group(uid="late", env_id=None)]))["status"] == "received"
            assert time.monotonic() - t0 >= 0.9  # waited for Retry-After: 1, not the 0.05 s backoff
            await drainer
            sent = counting.requests
            with pytest.raises(ApiRejected) as refused:
                await env.send_groups([make_group(n=3)])
            assert refused.value.status == 422 and "must divide 8" in refused.value.detail
            assert counting.requests == sent + 1  # a refusal is not retried

    asyncio.run(_with_app(tmp_path, {"max_queued_sequences": 16, "retry_after_s": 1}, body))


def test_env_client_keeps_refused_posts_in_the_outbox(tmp_path: Path) -> None:
    async def body(transport: httpx.AsyncBaseTransport, trainer: httpx.AsyncClient) -> None:
        await trainer.post("/register", json=ATROPOS_REGISTRATION)
        await trainer.get("/batch")
        async with EnvClient("http://api", transport=transport, outbox=tmp_path / "outbox.sqlite") as env:
            await env.register_env(RegisterEnv(**atropos_register_env(4)))
            ok = await env.submit([make_group(uid="a")])
            assert (ok.sent_groups, ok.parked_groups, ok.rejected) == (1, 0, [])
            refused = await env.submit([make_group(n=3)])
            assert refused.sent_groups == 0 and refused.rejected[0].status == 422
            assert env.outbox is not None and env.outbox.rejected()[0].detail.startswith("group 0: group has 3")
            assert (await env.submit([make_group(uid="b")])).sent_groups == 1

    asyncio.run(_with_app(tmp_path, {}, body))


def test_backpressure_counts_the_sequences_a_post_would_add(tmp_path: Path) -> None:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", max_queued_sequences=16))) as c:
        start(c)
        register_env(c)
        assert c.post("/scored_data_list", json=[make_group(uid=str(i)) for i in range(3)]).status_code == 200
        r = c.post("/scored_data_list", json=[make_group(uid="x"), make_group(uid="y")])  # 12 + 8 > 16
        assert r.status_code == 503 and "12 of 16 sequences" in r.json()["detail"]
        assert r.headers["Retry-After"] == "2"
        assert c.post("/scored_data", json=make_group(uid="fits")).status_code == 200


def test_one_ingest_worker_by_default_once_there_is_a_second_core(tmp_path: Path, monkeypatch) -> None:
    """The default takes checking off the server process only where a core is free for it."""
    from blackjack_rl.api import ingest_workers

    assert [ingest_workers.default_workers(n) for n in (1, 2, 16)] == [0, 1, 1]
    monkeypatch.delenv("BLACKJACK_RL_API_INGEST_WORKERS", raising=False)  # conftest's choice for test apps
    monkeypatch.setattr(ingest_workers, "usable_cpus", lambda: 2)
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite"))) as c:
        assert c.app.state.pool.workers == 1
        start(c)
        register_env(c)
        assert c.post("/scored_data", json=make_group(uid="d0")).status_code == 200
    monkeypatch.setattr(ingest_workers, "usable_cpus", lambda: 1)
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "b.sqlite"))) as c:
        assert c.app.state.pool.workers == 0


def test_a_script_without_a_main_guard_still_serves(tmp_path: Path) -> None:
    """Worker processes re-run an unguarded script and die; the API then checks posts itself."""
    script = tmp_path / "serve_here.py"
    script.write_text(
        "from fastapi.testclient import TestClient\n"
        "from blackjack_rl.api.server import create_app\n"
        "from blackjack_rl.api.settings import ApiConfig\n"
        f"with TestClient(create_app(ApiConfig(db_path={str(tmp_path / 'a.sqlite')!r}, ingest_workers=1))) as c:\n"
        "    print('workers', c.app.state.pool.workers, 'status', c.get('/status').status_code)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=cli_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "workers 0 status 200" in proc.stdout
    assert "could not start" in proc.stderr


def test_ingest_worker_processes_check_and_refuse_like_the_server(tmp_path: Path) -> None:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", ingest_workers=1))) as c:
        start(c)
        register_env(c)
        body = gzip.compress(json.dumps([make_group(uid="w0")]).encode())
        ok = c.post("/scored_data_list", content=body,
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert ok.status_code == 200
        assert c.post("/scored_data", json=make_group(uid="w1")).status_code == 200
        refused = c.post("/scored_data", json={**make_group(), "scores": [1.0]})
        assert refused.status_code == 422 and "scores has 1 entries" in refused.json()["detail"]
        assert uids(c.get("/batch").json()["batch"]) == ["w0", "w1"]


def test_ingest_workers_check_against_the_registrations_of_the_moment(tmp_path: Path) -> None:
    """A worker holds the run's registrations it was last sent: a change reaches it with the next post."""
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", ingest_workers=1))) as c:
        start(c, batch_size=8)
        first = register_env(c, group_size=4)
        assert c.post("/scored_data", json=make_group(env_id=first, uid="a")).status_code == 200
        unknown = c.post("/scored_data", json=make_group(env_id=first + 1, uid="b"))
        assert unknown.status_code == 422 and "is not registered" in unknown.json()["detail"]
        second = register_env(c, group_size=2)
        assert second == first + 1
        assert c.post("/scored_data", json=make_group(n=2, env_id=second, uid="b")).status_code == 200
        too_big = c.post("/scored_data", json=make_group(env_id=second, uid="c"))  # 4 > its group_size 2
        assert too_big.status_code == 422 and "registered group_size 2" in too_big.json()["detail"]
        assert c.post("/scored_data", json=make_group(n=2, env_id=second, uid="c")).status_code == 200
        assert c.get("/status").json()["queue_size"] == 3


def test_a_worker_that_dies_before_it_starts_is_not_started_again() -> None:
    """Replacing a worker that never started would start and lose processes in a loop: the pool
    goes on without it, checking posts in the server process when no worker is left."""
    import os
    import signal

    from blackjack_rl.api.ingest import IngestContext
    from blackjack_rl.api.ingest_workers import IngestPool

    ctx = IngestContext(batch_size=8, env_group_sizes={0: 4})
    body = json.dumps(make_group(uid="n0")).encode()

    async def run() -> tuple[int, int, int, Any]:
        pool = IngestPool(1)
        await pool.start()
        try:
            [first] = pool.pids
            os.kill(first, signal.SIGKILL)
            while pool.replaced == 0:  # the replacement is started at once
                await asyncio.sleep(0.001)
            [second] = pool.pids
            os.kill(second, signal.SIGKILL)  # long before its interpreter has started
            while pool.pids:
                await asyncio.sleep(0.01)
            checked = await pool.prepare(body, "identity", ctx, as_list=False, max_bytes=10**7, with_digest=False)
            return pool.replaced, pool.workers, len(pool.pids), checked
        finally:
            await pool.aclose()

    replaced, workers, live, (groups, _) = asyncio.run(run())
    assert (replaced, workers, live) == (1, 0, 0)
    assert len(groups) == 1  # checked in a thread of this process


def test_a_crashed_ingest_worker_is_replaced_once() -> None:
    """Every post in flight when a worker dies gets a 503 to retry; the worker is replaced once,
    not once per post (which would strand posts just handed to the new one), and works after."""
    import os
    import signal

    from blackjack_rl.api.errors import ApiError
    from blackjack_rl.api.ingest import IngestContext
    from blackjack_rl.api.ingest_workers import IngestPool

    ctx = IngestContext(batch_size=8, env_group_sizes={0: 4})
    body = json.dumps(make_group(uid="c0")).encode()

    async def run() -> tuple[list[Any], Any, int, int]:
        pool = IngestPool(1)
        await pool.start()
        try:
            [first] = pool.pids
            os.kill(first, signal.SIGKILL)
            # Handed to the worker before the event loop can see that it is gone.
            posts = [asyncio.ensure_future(
                pool.prepare(body, "identity", ctx, as_list=False, max_bytes=10**7, with_digest=i % 2 == 0)
            ) for i in range(6)]
            outcomes = await asyncio.gather(*posts, return_exceptions=True)
            after = await pool.prepare(body, "identity", ctx, as_list=False, max_bytes=10**7, with_digest=False)
            [second] = pool.pids
            assert second != first
            return outcomes, after, pool.replaced, len(pool.pids)
        finally:
            await pool.aclose()

    during, after, replaced, live = asyncio.run(run())
    assert all(isinstance(o, ApiError) and o.status == 503 and "send it again" in o.detail for o in during), during
    assert replaced == 1 and live == 1  # one replacement, not one per post
    groups, _ = after
    assert len(groups) == 1


def test_a_trainers_batch_timeout_bounds_its_retries_of_an_api_that_cannot_answer() -> None:
    """`train --batch-timeout` (TrainerClient.wait_for_batch) bounds the whole wait: an API that
    answers 503 gets retried until the deadline, not for the retry policy's 8 attempts (~15 s).
    Within 1 s the backoff (0.1, 0.2, 0.4 s at the least) leaves room for 4 attempts at most."""
    from canned_server import CannedServer

    from blackjack_rl.api import ApiUnavailable
    from blackjack_rl.api.client import TrainerClient

    with CannedServer({"detail": "restarting"}, status=503, get_status=503) as api:
        with TrainerClient(api.url.removesuffix("/v1")) as trainer, pytest.raises(ApiUnavailable):
            trainer.wait_for_batch(1.0)
    assert 1 <= api.gets <= 4, api.gets
