"""The API served by real uvicorn on 127.0.0.1: the direct ingest path and how batches are sent.

Posts to /scored_data and /scored_data_list skip FastAPI's layers when none of them would
change the answer (TrajectoryApp); they must answer byte for byte what the full stack
answers, and the bearer token and CORS must still apply. GET /batch is sent in pieces,
one per group, with the Content-Length of the whole.
"""

from __future__ import annotations

import gzip
import json
import platform
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group, uids
from helpers import free_port

from blackjack_rl.api import ApiConfig, create_app
from blackjack_rl.api.malloc import keep_freed_memory
from blackjack_rl.api.models import SCORED_DATA_FIELDS

pytestmark = pytest.mark.timeout(120)
GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` on uvicorn (httptools, uvloop where installed) in a thread, at the URL yielded."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def exchange(url: str, token: str | None = None) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """The same requests, in the same order: every answer of the ingest endpoints, kept whole."""
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    answers = []
    with httpx.Client(base_url=url, headers=auth, timeout=30) as http:

        def post(path: str, **kwargs: Any) -> None:
            r = http.post(path, **kwargs)
            headers = [(k, v.replace(url, "URL")) for k, v in r.headers.multi_items() if k not in ("date", "server")]
            answers.append((r.status_code, headers, r.content))

        post("/scored_data", json=make_group(uid="early"))  # 503: no trainer yet
        assert http.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": 8}).status_code == 200
        http.get("/batch")
        assert http.post("/register-env", json=atropos_register_env(4)).status_code == 200
        post("/scored_data", json=make_group(uid="a"))
        post("/scored_data_list", json=[make_group(uid="b")], headers={"Idempotency-Key": "k1"})
        post("/scored_data_list", json=[make_group(uid="b")], headers={"Idempotency-Key": "k1"})  # replayed
        post("/scored_data_list", json=[make_group(uid="c")], headers={"Idempotency-Key": "k1"})  # 409
        post("/scored_data_list", json=[make_group(uid="d")], headers={"Idempotency-Key": "k" * 201})  # 400
        post("/scored_data", content=b"{", headers={"Content-Type": "application/json"})  # 400
        post("/scored_data", content=b"x", headers={"Content-Encoding": "br"})  # 415
        post("/scored_data", content=b"not gzip", headers=GZIP)  # 400
        post("/scored_data", json={**make_group(uid="e"), "scores": [1.0]})  # 422
        post("/scored_data_list", content=json.dumps([make_group(uid="f")] * 100).encode())  # 413, over 64 KiB
        post("/scored_data", content=gzip.compress(json.dumps(make_group(uid="g")).encode()), headers=GZIP)
        post("/scored_data_list", json=[make_group(uid="h"), make_group(uid="i")])
        post("/scored_data", json=make_group(uid="j"))  # 503: the queue is full
        post("/scored_data/", json=make_group(uid="k"))  # not an endpoint: FastAPI's redirect
        answers.append((http.get("/status").status_code, [], http.get("/status").content))
    return answers


def test_posts_answer_the_same_bytes_with_or_without_fastapis_layers(tmp_path: Path) -> None:
    config = {"max_body_bytes": 64 * 1024, "max_queued_sequences": 20, "ingest_workers": 1}
    direct = create_app(ApiConfig(db_path=tmp_path / "direct.sqlite", **config))
    full = create_app(ApiConfig(db_path=tmp_path / "full.sqlite", **config))
    full.fast_ingest = None  # every request through FastAPI's middleware, routing and serialisation
    with served(direct) as url:
        through_direct = exchange(url)
    with served(full) as url:
        through_full = exchange(url)
    statuses = [status for status, _, _ in through_direct]
    assert statuses == [503, 200, 200, 200, 409, 400, 400, 415, 400, 422, 413, 200, 200, 503, 307, 200]
    assert through_direct == through_full


def polls(url: str) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """A trainer polling GET /batch through every state: before and after registering, with
    nothing queued, with a batch in flight (acknowledged or not), and with bad `ack`s."""
    answers = []
    with httpx.Client(base_url=url, timeout=30) as http:

        def get(path: str) -> None:
            r = http.get(path)
            headers = [(k, v) for k, v in r.headers.multi_items() if k not in ("date", "server")]
            answers.append((r.status_code, headers, r.content))

        get("/batch")  # no trainer
        assert http.post("/register", json={**ATROPOS_REGISTRATION, "batch_size": 8}).status_code == 200
        get("/batch")  # starts the trainer
        get("/batch")
        get("/batch?ack=0")
        assert http.post("/register-env", json=atropos_register_env(4)).status_code == 200
        assert http.post("/scored_data", json=make_group(uid="a")).status_code == 200
        get("/batch?ack=7")  # 4 of 8 sequences queued
        assert http.post("/scored_data", json=make_group(uid="b")).status_code == 200
        get("/batch?ack=0")  # batch 1 goes out
        get("/batch?ack=0")  # not acknowledged: sent again
        get("/batch?ack=1")  # acknowledged; nothing more
        get("/batch?ack=1")
        get("/batch")
        for bad in ("ack=-1", "ack=x", f"ack={2**63}", "ack=", "ack=1&ack=2", "other=1"):
            get(f"/batch?{bad}")
        answers.append((200, [], http.get("/status").content))
    return answers


def test_polls_for_batches_answer_the_same_without_fastapis_layers(tmp_path: Path) -> None:
    direct = create_app(ApiConfig(db_path=tmp_path / "direct.sqlite"))
    full = create_app(ApiConfig(db_path=tmp_path / "full.sqlite"))
    full.fast_ingest = full.fast_batch = None
    with served(direct) as url:
        through_direct = polls(url)
    with served(full) as url:
        through_full = polls(url)
    bodies = [json.loads(body) for _, _, body in through_direct]
    assert [b.get("batch") for b in bodies[:5]] == [[], None, None, None, None]
    assert uids(bodies[5]["batch"]) == ["a", "b"] and bodies[6]["redelivered"] is True
    assert [b["batch"] for b in bodies[7:9]] == [None, None]
    assert [status for status, _, _ in through_direct][10:16] == [422, 422, 422, 422, 200, 200]
    assert through_direct == through_full


def test_the_token_and_cors_still_guard_posts(tmp_path: Path) -> None:
    config = ApiConfig(db_path=tmp_path / "a.sqlite", token="s3cret", cors_origins=["https://dash.example"])
    with served(create_app(config)) as url:
        answers = exchange(url, token="s3cret")
        assert [status for status, _, _ in answers][:3] == [503, 200, 200]
        with httpx.Client(base_url=url, timeout=30) as http:
            group = make_group(uid="z")
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = http.post("/scored_data", json=group, headers=headers)
                assert r.status_code == 401 and "bearer token" in r.json()["detail"]
            # The middleware reads the first Authorization header; so does the direct path.
            twice = [("Authorization", ""), ("Authorization", "Bearer s3cret")]
            assert http.post("/scored_data", json=group, headers=twice).status_code == 401
            assert http.get("/batch", headers=twice).status_code == 401
            origin = {"Origin": "https://dash.example", "Authorization": "Bearer s3cret"}
            r = http.post("/scored_data", json=make_group(n=1, uid="y"), headers=origin)
            assert r.status_code == 200 and r.json() == {"status": "received"}
            assert r.headers["access-control-allow-origin"] == "https://dash.example"
            preflight = http.options("/scored_data", headers={
                "Origin": "https://dash.example", "Access-Control-Request-Method": "POST"})
            assert preflight.status_code == 200


def test_a_batch_is_sent_in_pieces_with_the_length_of_the_whole(tmp_path: Path) -> None:
    """Groups stored as the client's gzip stream, as zlib, and with Atropos fields left out."""
    with served(create_app(ApiConfig(db_path=tmp_path / "a.sqlite", ingest_workers=1))) as url:
        with httpx.Client(base_url=url, timeout=30) as http:
            registration = {**ATROPOS_REGISTRATION, "batch_size": 16, "max_token_len": 4096}
            assert http.post("/register", json=registration).status_code == 200
            http.get("/batch")
            assert http.post("/register-env", json=atropos_register_env(4)).status_code == 200
            big = make_group(length=2000, prompt=100, uid="big")  # larger than a piece sent whole
            sparse = {k: v for k, v in make_group(uid="sparse").items() if k != "inference_logprobs"}
            posts = [
                ("/scored_data_list", gzip.compress(json.dumps([big]).encode()), GZIP),
                ("/scored_data", json.dumps(make_group(uid="plain")).encode(), {"Content-Type": "application/json"}),
                ("/scored_data", gzip.compress(json.dumps(sparse).encode()), GZIP),
                ("/scored_data_list", gzip.compress(json.dumps([make_group(uid="last")]).encode()), GZIP),
            ]
            for path, body, headers in posts:
                assert http.post(path, content=body, headers=headers).status_code == 200
            r = http.get("/batch")
    assert r.status_code == 200
    assert int(r.headers["content-length"]) == len(r.content)
    batch = json.loads(r.content)
    assert uids(batch["batch"]) == ["big", "plain", "sparse", "last"]
    assert all(set(SCORED_DATA_FIELDS) <= set(g) for g in batch["batch"])
    assert batch["batch"][2]["inference_logprobs"] is None
    assert batch["batch"][0]["tokens"] == big["tokens"]
    assert batch["batch_id"] > 0 and batch["redelivered"] is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_server_keeps_freed_memory_for_reuse() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # and may be asked again
