"""Wire compatibility with Atropos' own trajectory API, the real `run-api` of atroposlib 0.4.0.

`blackjack-rl serve` must feed run-api unchanged, and where both servers answer the same
request they must agree (types included) unless docs/api.md lists the difference.
Needs the `atropos` extra (CI installs it: `pip install --no-deps atroposlib==0.4.0`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from blackjack_rl.api.client import TrainerClient
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group
from helpers import RunApiProcess, ServerProcess
from test_serve import metrics_rows, start_serve

pytest.importorskip(
    "atroposlib.api.server",
    reason="the `atropos` extra is not installed (pip install --no-deps atroposlib==0.4.0)",
)


def _serving(server: ServerProcess) -> Iterator[ServerProcess]:
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def run_api(tmp_path: Path) -> Iterator[ServerProcess]:
    yield from _serving(RunApiProcess(tmp_path / "run-api.db"))


@pytest.fixture
def ours(tmp_path: Path) -> Iterator[ServerProcess]:
    yield from _serving(ServerProcess(tmp_path / "ours.sqlite"))


def _pull(trainer: TrainerClient, want_groups: int, attempts: int) -> list[dict[str, Any]]:
    """Groups from GET /batch, asked at most `attempts` times, with our TrainerClient (run-api numbers
    no batches: nothing to ack)."""
    got: list[dict[str, Any]] = []
    for _ in range(attempts):
        if len(got) >= want_groups:
            break
        batch = trainer.get_batch()
        if batch is not None:
            assert batch.batch_id is None and batch.step == -1
            got.extend(batch.groups)
        else:
            time.sleep(0.1)
    return got


@pytest.mark.slow  # Atropos' server end to end, with our worker and trainer
def test_serve_feeds_atropos_run_api(run_api: ServerProcess, tmp_path: Path) -> None:
    """Our worker and our trainer client, with Atropos' server between them."""
    trainer = TrainerClient(run_api.url)
    assert trainer.get_batch() is None  # before registering: run-api answers "batch": []
    trainer.register(ATROPOS_REGISTRATION)
    assert trainer.get_batch() is None  # the trainer has started
    serve = start_serve(run_api.url, tmp_path / "w", "--max-groups", "4", "--register-timeout", "60")
    try:
        groups = _pull(trainer, 4, attempts=900)
        out, _ = serve.communicate(timeout=90)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 0, out
    # run-api drops fields it does not know (our per-episode metadata): tell groups apart by tokens
    assert len(groups) == 4 and len({tuple(map(tuple, g["tokens"])) for g in groups}) == 4
    assert all(type(s) is float for g in groups for s in g["scores"])
    rows = metrics_rows(tmp_path / "w")
    assert rows[0]["kind"] == "registered" and rows[-1]["kind"] == "stopped" and rows[-1]["sent"] == 4


def _answer(response: httpx.Response) -> tuple[int, Any]:
    try:
        return response.status_code, response.json()
    except json.JSONDecodeError:
        return response.status_code, response.text


def test_both_servers_answer_alike(run_api: ServerProcess, ours: ServerProcess) -> None:
    """Requests with a defined answer get the same status, and the same body where it is data."""
    urls = {"run-api": run_api.url, "ours": ours.url}

    def both(method: str, path: str, **kwargs: Any) -> dict[str, tuple[int, Any]]:
        return {name: _answer(httpx.request(method, url + path, timeout=10, **kwargs)) for name, url in urls.items()}

    before = both("GET", "/batch")
    assert before["ours"] == before["run-api"]  # [] before any trainer registered
    for field in ATROPOS_REGISTRATION:
        body = {**ATROPOS_REGISTRATION, field: None}
        assert {status for status, _ in both("POST", "/register", json=body).values()} == {422}, field
    assert {s for s, _ in both("POST", "/register", json=ATROPOS_REGISTRATION).values()} == {200}
    assert both("GET", "/batch")["ours"][1]["batch"] is None
    for field in ("max_token_length", "desired_name", "weight", "group_size"):
        body = {**atropos_register_env(4), field: None}
        assert {s for s, _ in both("POST", "/register-env", json=body).values()} == {422}, field
    assert {s for s, _ in both("POST", "/disconnect-env", json={"env_id": None}).values()} == {422}
    registered = both("POST", "/register-env", json=atropos_register_env(4))
    assert registered["ours"][1]["env_id"] == registered["run-api"][1]["env_id"] == 0
    # env_id as a JSON body on GET, as atroposlib sends it
    status_env = both("GET", "/status-env", json={"env_id": 0})
    assert status_env["ours"][0] == status_env["run-api"][0] == 200
    assert set(status_env["run-api"][1]) <= set(status_env["ours"][1])

    g = make_group()
    nulls = both("POST", "/scored_data", json={**g, "overrides": [None, {}, {}, {}]})
    assert {s for s, _ in nulls.values()} == {422}

    integers = make_group(uid="ints")
    integers["scores"] = [1, 0, 1, 0]
    for group in (integers, make_group(uid="floats")):
        assert {s for s, _ in both("POST", "/scored_data", json=group).values()} == {200}
    batches = both("GET", "/batch")
    for name, (status, body) in batches.items():
        assert status == 200, name
        scores = [s for grp in body["batch"] for s in grp["scores"]]
        assert all(type(s) is float for s in scores), (name, scores)
    ours_scores, their_scores = (sorted(s for grp in batches[n][1]["batch"] for s in grp["scores"]) for n in urls)
    assert ours_scores == their_scores
