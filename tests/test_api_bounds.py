"""Nothing a client sends may stall the API or slip past a promised check.

Bounds on every client-chosen number, gzip bodies of many members, checks on every field
the docs name, Idempotency-Keys reused for other data, Atropos' `null` rules, and the
lease that keeps a dead worker from holding batches.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group
from fastapi.testclient import TestClient

from blackjack_rl.api import ApiConfig, create_app
from blackjack_rl.api.batching import divisors, divisors_text, window_for
from blackjack_rl.api.body import MAX_GZIP_MEMBERS, gunzip_limited
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import prepare_groups
from blackjack_rl.api.models import Registration, RegisterEnv
from blackjack_rl.api.store import Store

GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    """A running app with a trainer (batches of 8) that has started, and env 0 (groups of 4)."""
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))) as client:
        assert client.post("/register", json=ATROPOS_REGISTRATION).status_code == 200
        client.get("/batch")
        assert client.post("/register-env", json=atropos_register_env(4)).json()["env_id"] == 0
        yield client


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))) as client:
        yield client


# --- gzip ------------------------------------------------------------------------------------


def test_many_gzip_members_are_refused_at_once(api: TestClient) -> None:
    """100k empty members (2 MB) used to be decompressed in quadratic time on the event loop."""
    bomb = gzip.compress(b"") * 100_000
    r = api.post("/scored_data_list", content=bomb, headers=GZIP)
    assert r.status_code == 400 and "members" in r.json()["detail"]
    r = api.post("/register-env", content=bomb, headers=GZIP)  # every endpoint decodes the same way
    assert r.status_code == 400 and "members" in r.json()["detail"]
    assert api.get("/status").status_code == 200


def test_a_body_split_over_gzip_members_is_accepted(api: TestClient) -> None:
    text = json.dumps([make_group(uid="split")]).encode()
    cut = [0, 7, len(text) // 2, len(text) - 3, len(text)]
    body = b"".join(gzip.compress(text[a:b]) for a, b in zip(cut, cut[1:]))
    r = api.post("/scored_data_list", content=body + b"\x00" * 5, headers=GZIP)
    assert r.status_code == 200, r.text


def test_gunzip_agrees_with_gzip_and_is_bounded() -> None:
    parts = [os.urandom(50_000), b"", b"x" * 300_000, json.dumps(make_group()).encode()]
    body = b"".join(gzip.compress(p, compresslevel=level) for p, level in zip(parts, (1, 6, 9, 1)))
    assert gunzip_limited(body, 10**7) == (gzip.decompress(body), 4)
    assert gunzip_limited(body + b"\x00\x00", 10**7) == (gzip.decompress(body), 4)
    with pytest.raises(ApiError, match="truncated"):
        gunzip_limited(body[:-5], 10**7)
    with pytest.raises(ApiError, match="not valid gzip"):
        gunzip_limited(body + b"garbage", 10**7)
    with pytest.raises(ApiError, match="exceeds the limit"):
        gunzip_limited(body, 200_000)
    many = gzip.compress(b"a") * (MAX_GZIP_MEMBERS + 1)
    with pytest.raises(ApiError, match="members"):
        gunzip_limited(many, 10**7)
    # linear without the cap: a large number of members decodes (the old loop copied the rest each time)
    assert gunzip_limited(gzip.compress(b"ab") * 20_000, 10**7, max_members=10**6) == (b"ab" * 20_000, 20_000)


# --- client-chosen numbers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"batch_size": 10**12},
        {"batch_size": 65_537},
        {"max_token_len": 2**70},
        {"starting_step": 2**70},
        {"num_steps": 2**70},
        {"save_checkpoint_interval": -(2**70)},
        {"wandb_group": "g" * 10_000},
        {"checkpoint_dir": "d" * 100_000},
    ],
)
def test_registration_numbers_are_bounded(fresh: TestClient, change: dict[str, Any]) -> None:
    r = fresh.post("/register", json={**ATROPOS_REGISTRATION, **change})
    assert r.status_code == 422, r.text
    assert fresh.get("/info").json() == {"batch_size": -1, "max_token_len": -1}


def test_batch_size_beyond_the_queue_is_refused(tmp_path: Path) -> None:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", max_queued_sequences=100))) as client:
        r = client.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": 128})
        assert r.status_code == 422 and "never be filled" in r.json()["detail"]


@pytest.mark.parametrize(
    "change",
    [{"max_token_length": 2**70}, {"group_size": 2**40}, {"weight": 1e300}, {"desired_name": "n" * 10_000}],
)
def test_environment_numbers_are_bounded(api: TestClient, change: dict[str, Any]) -> None:
    assert api.post("/register-env", json={**atropos_register_env(4), **change}).status_code == 422


@pytest.mark.parametrize("query", ["/status-env?env_id=1180591620717411303424", "/batch?ack=1180591620717411303424",
                                   "/status-env?env_id=-1"])
def test_query_numbers_are_bounded(api: TestClient, query: str) -> None:
    assert api.get(query).status_code == 422


def test_out_of_range_ids_in_bodies_are_refused(api: TestClient) -> None:
    assert api.post("/disconnect-env", json={"env_id": 2**70}).status_code == 422
    assert api.request("GET", "/status-env", json={"env_id": 2**70}).status_code == 422
    assert api.post("/scored_data", json=make_group(env_id=2**70)).status_code == 422


def test_error_messages_never_enumerate_a_large_number(fresh: TestClient) -> None:
    assert fresh.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": 65_536}).status_code == 200
    fresh.get("/batch")
    detail = fresh.post("/register-env", json=atropos_register_env(3)).json()["detail"]
    assert "65536" in detail and len(detail) < 400
    detail = fresh.post("/scored_data", json=make_group(n=3, env_id=None)).json()["detail"]
    assert "(17 in all)" in detail and len(detail) < 400


def test_divisors_are_found_without_counting_to_n() -> None:
    assert divisors(1) == (1,) and divisors(36) == (1, 2, 3, 4, 6, 9, 12, 18, 36)
    assert divisors(65_521) == (1, 65_521)  # prime
    assert divisors_text(12) == "1, 2, 3, 4, 6, 12"
    assert divisors_text(720720).endswith("720720 (240 in all)")
    assert window_for(8) == sum(8 // s - 1 for s in (1, 2, 4, 8)) + 1


# --- every documented check on every field ---------------------------------------------------


def _with_distill(group: dict[str, Any], ids: Any, logprobs: Any) -> dict[str, Any]:
    return {**group, "distill_token_ids": ids, "distill_logprobs": logprobs}


def _distill_shape(group: dict[str, Any], value: Any) -> list[list[list[Any]]]:
    return [[[value, value] for _ in seq] for seq in group["tokens"]]


def test_distill_fields_get_the_token_and_finiteness_checks(api: TestClient) -> None:
    g = make_group()
    ok = _with_distill(g, _distill_shape(g, 3), _distill_shape(g, -0.5))
    assert api.post("/scored_data", json=ok).status_code == 200
    nan = json.dumps(_with_distill(g, _distill_shape(g, 3), _distill_shape(g, -0.5)))
    nan = nan.replace("-0.5]]]", "NaN]]]", 1)
    r = api.post("/scored_data", content=nan, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "distill_logprobs" in r.json()["detail"] and "finite" in r.json()["detail"]
    negative = _with_distill(g, _distill_shape(g, -3), _distill_shape(g, -0.5))
    r = api.post("/scored_data", json=negative)
    assert r.status_code == 422 and "distill_token_ids" in r.json()["detail"]
    huge = _with_distill(g, _distill_shape(g, 2**40), _distill_shape(g, -0.5))
    assert api.post("/scored_data", json=huge).status_code == 422


# --- Atropos' null rules, integer scores ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/register", {**ATROPOS_REGISTRATION, "wandb_group": None}),
        ("/register", {**ATROPOS_REGISTRATION, "wandb_project": None}),
        ("/register-env", atropos_register_env(4, weight=None)),
    ],
)
def test_null_is_refused_where_atropos_refuses_it(api: TestClient, path: str, body: dict[str, Any]) -> None:
    assert api.post(path, json=body).status_code == 422


def test_null_overrides_entries_are_refused(api: TestClient) -> None:
    g = make_group()
    assert api.post("/scored_data", json={**g, "overrides": [None, {}, {}, {}]}).status_code == 422
    assert api.post("/scored_data", json={**g, "overrides": None, "group_overrides": None}).status_code == 200


def test_missing_registration_fields_take_defaults(fresh: TestClient) -> None:
    """Lax where Atropos is strict, on purpose (docs/api.md): a bare registration works."""
    assert fresh.post("/register", json={"batch_size": 8, "max_token_len": 512}).status_code == 200
    assert fresh.get("/wandb_info").json() == {"group": "", "project": ""}


@pytest.mark.parametrize("gzipped", [False, True])
def test_integer_scores_come_back_as_floats(api: TestClient, gzipped: bool) -> None:
    g = make_group()
    g["scores"] = [1, 0, -1, 2]
    g["inference_logprobs"] = [[1] * len(seq) for seq in g["tokens"]]
    g["advantages"] = [[0] * len(seq) for seq in g["tokens"]]
    other = make_group(uid="floats")
    for group in (g, other):
        text = json.dumps(group).encode()
        if gzipped:
            r = api.post("/scored_data", content=gzip.compress(text), headers=GZIP)
        else:
            r = api.post("/scored_data", content=text, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
    raw = api.get("/batch").content
    batch = json.loads(raw)["batch"]
    first = batch[0]
    assert first["scores"] == [1.0, 0.0, -1.0, 2.0]
    assert all(type(x) is float for x in first["scores"])
    assert all(type(x) is float for seq in first["inference_logprobs"] for x in seq)
    assert all(type(x) is float for seq in first["advantages"] for x in seq)
    assert first["episodes"] == g["episodes"] and first["env_id"] == 0  # nothing else changed
    assert all(type(x) is float for x in batch[1]["scores"])


# --- idempotency -------------------------------------------------------------------------------


def test_a_reused_idempotency_key_with_another_body_is_refused(api: TestClient) -> None:
    headers = {"Idempotency-Key": "k1"}
    first = api.post("/scored_data", json=make_group(uid="a"), headers=headers)
    assert first.status_code == 200
    again = api.post("/scored_data", json=make_group(uid="a"), headers=headers)
    assert again.status_code == 200 and again.json() == first.json()  # a retry: answered, queued once
    other = api.post("/scored_data", json=make_group(uid="b"), headers=headers)
    assert other.status_code == 409 and "different body" in other.json()["detail"]
    same_bytes_other_endpoint = api.post("/scored_data_list", json=[make_group(uid="a")], headers=headers)
    assert same_bytes_other_endpoint.status_code == 409
    assert api.get("/status").json()["queue_size"] == 1


# --- leases and takeover (the Store, with a clock the test moves) -----------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _started_store(tmp_path: Path, clock: Clock) -> Store:
    store = Store(tmp_path / "s.sqlite", env_lease_s=30.0, clock=clock)
    store.register_trainer(Registration(batch_size=8, max_token_len=512))
    assert store.next_batch(None) is None
    return store


def _post(store: Store, env_id: int, uid: str) -> None:
    raw = json.dumps(make_group(env_id=env_id, uid=uid)).encode()
    groups = prepare_groups(raw, "identity", store.context, as_list=False, max_bytes=10**7)
    store.enqueue(groups, as_list=False, idempotency_key=None, generation=store.generation)


def test_a_silent_environment_stops_holding_its_share(tmp_path: Path) -> None:
    clock = Clock()
    store = _started_store(tmp_path, clock)
    try:
        dead = store.register_env(RegisterEnv(max_token_length=512, desired_name="bj", group_size=4,
                                              min_batch_allocation=0.5))["env_id"]
        live = store.register_env(RegisterEnv(max_token_length=512, desired_name="bj", group_size=4))["env_id"]
        for i in range(4):
            _post(store, live, f"live{i}")
        assert store.next_batch(None) is None  # `dead` is owed half of every batch, as in Atropos
        assert store.status_env(live)["unallocated_fraction"] == 0.5
        clock.now += 31  # `dead` said nothing for longer than the lease; `live` polls
        store.status_env(live)
        _post(store, live, "live4")
        batch = store.next_batch(None)
        assert batch is not None and len(batch.payloads) == 2
        assert store.status_env(live)["unallocated_fraction"] == 1.0
        store.status_env(dead)  # heard from again: owed its share again
        assert store.status_env(live)["unallocated_fraction"] == 0.5
        assert store.next_batch(None) is None
    finally:
        store.close()


def test_every_request_naming_an_environment_renews_its_lease(tmp_path: Path) -> None:
    """Polls and posts (a retried one too) are heard; silence longer than the lease is not."""
    clock = Clock()
    store = _started_store(tmp_path, clock)  # lease 30 s
    try:
        owed = store.register_env(RegisterEnv(max_token_length=512, desired_name="bj", group_size=4,
                                              min_batch_allocation=0.5))["env_id"]
        other = store.register_env(RegisterEnv(max_token_length=512, desired_name="bj", group_size=4))["env_id"]

        def still_owed() -> bool:
            return store.status_env(other)["unallocated_fraction"] == 0.5

        raw = json.dumps(make_group(env_id=owed, uid="retried")).encode()
        groups = prepare_groups(raw, "identity", store.context, as_list=False, max_bytes=10**7)
        heartbeats = [
            lambda: store.status_env(owed),
            lambda: _post(store, owed, "posted"),
            lambda: store.enqueue(groups, as_list=False, idempotency_key="k", generation=store.generation),
            lambda: store.enqueue(groups, as_list=False, idempotency_key="k", generation=store.generation),  # replayed
        ]
        for beat in heartbeats:
            clock.now += 20
            beat()
            clock.now += 20  # 40 s since the one before, 20 s since this one
            assert still_owed()
        clock.now += 31
        assert not still_owed()
        store.status_env(owed)
        assert still_owed()
        store.disconnect_env(owed)  # heard, and gone
        assert not still_owed()
    finally:
        store.close()


def test_the_default_lease_is_a_few_worker_polls() -> None:
    """Three polls of `blackjack-rl serve` (one a second): a dead worker's share is released within 10 s."""
    from blackjack_rl.api.store import DEFAULT_ENV_LEASE_S
    from blackjack_rl.config import ServeConfig

    default = ApiConfig.model_fields["env_lease_s"].default
    assert default == DEFAULT_ENV_LEASE_S
    assert 2 * ServeConfig().poll_interval < default <= 10


@pytest.mark.parametrize("value", [0.1, 0, -1, float("nan"), float("inf"), 1e9])
def test_an_env_lease_out_of_bounds_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="env_lease_s"):
        ApiConfig(env_lease_s=value)


def test_a_worker_that_registers_again_takes_over_its_registration(tmp_path: Path) -> None:
    clock = Clock()
    store = _started_store(tmp_path, clock)
    try:
        def register(worker: str | None, **extra: Any) -> dict[str, Any]:
            req = RegisterEnv(max_token_length=512, desired_name="bj", group_size=4, worker_id=worker, **extra)
            return store.register_env(req)

        first = register("w1", min_batch_allocation=0.5)
        assert register("w2")["env_id"] != first["env_id"]
        store.disconnect_env(first["env_id"])
        again = register("w1", min_batch_allocation=0.25)
        assert again["env_id"] == first["env_id"] and again["wandb_name"] == first["wandb_name"]
        assert store.mirror.envs[first["env_id"]].connected
        assert store.mirror.envs[first["env_id"]].min_batch_allocation == 0.25
        assert register(None)["env_id"] != register(None)["env_id"]  # Atropos clients: one env per call
        assert len(store.mirror.envs) == 4
    finally:
        store.close()
    reopened = Store(tmp_path / "s.sqlite")
    try:  # takeover survives a restart of the API
        assert reopened.mirror.envs[first["env_id"]].worker_id == "w1"
        req = RegisterEnv(max_token_length=512, desired_name="bj", group_size=4, worker_id="w1")
        assert reopened.register_env(req)["env_id"] == first["env_id"]
    finally:
        reopened.close()


def test_a_second_store_through_another_name_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    try:
        os.link(tmp_path / "db.sqlite", tmp_path / "hard.sqlite")
        (tmp_path / "soft.sqlite").symlink_to(tmp_path / "db.sqlite")
        for name in ("db.sqlite", "hard.sqlite", "soft.sqlite"):
            with pytest.raises(OSError, match="another trajectory API process"):
                Store(tmp_path / name)
        store.register_trainer(Registration(batch_size=8, max_token_len=512))
    finally:
        store.close()
    Store(tmp_path / "hard.sqlite").close()  # free again once the first is closed


def test_an_outbox_is_held_by_one_process_under_any_name(tmp_path: Path) -> None:
    from blackjack_rl.api.outbox import Outbox

    box = Outbox(tmp_path / "outbox.sqlite")
    try:
        os.link(tmp_path / "outbox.sqlite", tmp_path / "hard.sqlite")
        for name in ("outbox.sqlite", "hard.sqlite"):
            with pytest.raises(OSError, match="another environment worker process"):
                Outbox(tmp_path / name)
        box.put("k", b"body", 1)
    finally:
        box.close()
    reopened = Outbox(tmp_path / "hard.sqlite")
    try:
        assert reopened.pending_groups() == 1
    finally:
        reopened.close()


def test_groups_per_post_are_bounded(api: TestClient) -> None:
    from blackjack_rl.api.ingest import MAX_GROUPS_PER_POST

    tiny = {"tokens": [[1]], "masks": [[1]], "scores": [0.0]}
    r = api.post("/scored_data_list", json=[tiny] * (MAX_GROUPS_PER_POST + 1))
    assert r.status_code == 413 and f"at most {MAX_GROUPS_PER_POST}" in r.json()["detail"]
    assert api.get("/status").json()["queue_size"] == 0
    assert api.post("/scored_data_list", json=[tiny] * 8).status_code == 200


def test_a_database_from_before_these_columns_opens(tmp_path: Path) -> None:
    """Older files: no worker_id or digest columns, and a trainer stored with `wandb_group: null`."""
    import sqlite3

    db = sqlite3.connect(tmp_path / "old.sqlite")
    db.executescript(
        """
        CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE envs(env_id INTEGER PRIMARY KEY, desired_name TEXT NOT NULL, real_name TEXT NOT NULL,
            max_token_length INTEGER NOT NULL, weight REAL NOT NULL, group_size INTEGER NOT NULL,
            min_batch_allocation REAL, connected INTEGER NOT NULL, registered_at REAL NOT NULL);
        CREATE TABLE idempotency(key TEXT PRIMARY KEY, response TEXT NOT NULL, created_at REAL NOT NULL);
        INSERT INTO envs VALUES(0, 'bj', 'bj_0', 512, 1.0, 4, NULL, 1, 0);
        INSERT INTO idempotency VALUES('old-key', '{"status": "received"}', 1e12);
        """
    )
    trainer = {**ATROPOS_REGISTRATION, "wandb_group": None, "wandb_project": None}
    db.executemany("INSERT INTO meta VALUES(?, ?)",
                   [("schema_version", "1"), ("trainer", json.dumps(trainer)), ("step", "3"), ("started", "1")])
    db.commit()
    db.close()
    store = Store(tmp_path / "old.sqlite")
    try:
        assert store.mirror.trainer is not None and store.mirror.trainer.wandb_group == ""
        assert store.mirror.envs[0].worker_id is None and store.mirror.step == 3
        req = RegisterEnv(max_token_length=512, desired_name="bj", group_size=4, worker_id="w")
        assert store.register_env(req)["env_id"] == 1
        raw = json.dumps(make_group(env_id=0, uid="x")).encode()
        groups = prepare_groups(raw, "identity", store.context, as_list=False, max_bytes=10**7)
        # a key remembered without a digest is replayed, whatever the body
        answer = store.enqueue(groups, as_list=False, idempotency_key="old-key", generation=store.generation,
                               digest="abc")
        assert answer == {"status": "received"} and store.status()["queue_size"] == 0
    finally:
        store.close()


@pytest.mark.parametrize(
    "body",
    [
        gzip.compress(b'{"a": 1}'),
        gzip.compress(b"x" * 70_000),  # larger than one slice of the stdlib path
        gzip.compress(b"ab") + gzip.compress(b"cd"),  # two members
        gzip.compress(b"ab") + b"\x00" * 8,  # zero padding
        gzip.compress(b"x" * 5000)[:-6],  # truncated
        gzip.compress(b"hello")[:-8] + b"\x00\x00\x00\x00" + gzip.compress(b"hello")[-4:],  # bad CRC
        gzip.compress(b"hello")[:-4] + b"\x09\x00\x00\x00",  # bad length
        gzip.compress(b"y" * 3000),  # over the limit below
        b"not gzip at all",
        b"",
    ],
    ids=["one member", "70 KB", "two members", "zero padding", "truncated", "bad CRC", "bad length", "over the limit",
         "not gzip", "empty"],  # gzip headers carry the time: ids from the bytes would differ per process
)
def test_isal_decompression_answers_as_the_stdlib(body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """ISA-L takes the usual single stream; every body gets what the stdlib alone would give."""
    from blackjack_rl.api import body as body_module

    def outcome() -> object:
        try:
            return gunzip_limited(body, 2048)
        except ApiError as exc:
            return (exc.status, exc.detail)

    assert body_module.fast_zlib is not None
    with_isal = outcome()
    monkeypatch.setattr(body_module, "fast_zlib", None)
    assert with_isal == outcome()


def test_stored_payloads_read_back_alike_with_or_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    import zlib

    from blackjack_rl.api import ingest

    text = json.dumps(make_group(uid="s")).encode()
    stored = [
        (ingest.FMT_ZLIB, zlib.compress(text, 1), b""),
        (ingest.FMT_GZIP_OBJECT, gzip.compress(b"  " + text + b"\n"), b',"images":null'),
        (ingest.FMT_GZIP_LIST1, gzip.compress(b"[" + text + b"]"), b""),
        (ingest.FMT_GZIP_LIST1, gzip.compress(b"[" + text + b"]") + b"\x00\x00", b""),  # padded as sent
    ]
    with_isal = [ingest.decode_payload(*p) for p in stored]
    monkeypatch.setattr(ingest, "fast_zlib", None)
    assert with_isal == [ingest.decode_payload(*p) for p in stored]
    assert json.loads(with_isal[1])["images"] is None and json.loads(with_isal[3]) == json.loads(text)
