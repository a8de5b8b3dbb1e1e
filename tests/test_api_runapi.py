"""Wire compatibility with Atropos' own trajectory API, the real `run-api` of atroposlib 0.4.0.

`blackjack-rl serve` must feed run-api unchanged, and where both servers answer the same
request they must agree (types included) unless docs/api.md lists the difference.
Needs the `atropos` extra (CI installs it: `pip install --no-deps atroposlib==0.4.0`).
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from blackjack_rl.api.batching import runapi_buffer_release
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
    # A lease longer than the test: whether an environment is still owed its share must not
    # depend on how fast this machine replays the requests (the lease is a documented difference).
    yield from _serving(ServerProcess(tmp_path / "ours.sqlite", args=["--env-lease", "600"]))


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


def _both(urls: dict[str, str]) -> Any:
    def both(method: str, path: str, **kwargs: Any) -> dict[str, tuple[int, Any]]:
        return {name: _answer(httpx.request(method, url + path, timeout=10, **kwargs)) for name, url in urls.items()}

    return both


def _post(both: Any, groups: list[dict[str, Any]], how: str) -> None:
    """POST groups to both servers: one group as JSON or gzip to /scored_data, or a list to /scored_data_list."""
    if how.startswith("list") or len(groups) > 1:
        path, body = "/scored_data_list", json.dumps(groups).encode()
    else:
        path, body = "/scored_data", json.dumps(groups[0]).encode()
    headers = {"Content-Type": "application/json"}
    if how.endswith("gzip"):
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    answers = both("POST", path, content=body, headers=headers)
    assert {status for status, _ in answers.values()} == {200}, answers


def test_both_servers_count_the_queue_alike(run_api: ServerProcess, ours: ServerProcess) -> None:
    """/status-env gives the same numbers after every post, groups of other sizes than group_size included.

    run-api holds such groups (failed episodes dropped: 2, 1 and 1 of 4) back until some add up
    to group_size, and never releases a larger one; we queue them at once (docs/api.md), and
    count them as run-api does. Only posts: forming batches is where the servers differ.
    """
    both = _both({"run-api": run_api.url, "ours": ours.url})
    assert {s for s, _ in both("POST", "/register", json=ATROPOS_REGISTRATION).values()} == {200}
    both("GET", "/batch")
    envs = []
    for body in (atropos_register_env(4), atropos_register_env(4, min_batch_allocation=0.5),
                 atropos_register_env(2, name="pairs", weight=3.0), atropos_register_env(1, name="singles")):
        answers = both("POST", "/register-env", json=body)
        assert answers["ours"][1]["env_id"] == answers["run-api"][1]["env_id"]
        envs.append(answers["ours"][1]["env_id"])
    full, owed, pairs, singles = envs
    eight = {**make_group(n=8, env_id=owed), "group_overrides": {"group_size": 8}}
    posts: list[tuple[list[dict[str, Any]], str]] = [
        ([make_group(n=1, env_id=singles)], "json"),
        ([make_group(n=1, env_id=singles)], "gzip"),
        ([make_group(n=2, env_id=full)], "json"),  # held by run-api
        ([make_group(n=1, env_id=full)], "gzip"),
        ([make_group(n=1, env_id=full)], "json"),  # 2 + 1 + 1: released
        ([make_group(n=4, env_id=owed)], "list"),
        ([make_group(n=2, env_id=None)], "json"),  # no env_id: queued by both
        ([make_group(n=1, env_id=pairs)], "list-gzip"),
        ([make_group(n=2, env_id=owed), make_group(n=2, env_id=owed)], "list"),
        ([eight], "json"),  # larger than group_size: run-api never releases it
        ([make_group(n=2, env_id=pairs), make_group(n=1, env_id=pairs)], "list-gzip"),
        ([make_group(n=2, env_id=full), make_group(n=4, env_id=full), make_group(n=2, env_id=full)], "list"),
        ([make_group(n=1, env_id=owed)], "gzip"),
    ]
    for number, (groups, how) in enumerate(posts):
        _post(both, groups, how)
        for env in envs:
            answers = both("GET", "/status-env", json={"env_id": env})
            assert answers["ours"] == answers["run-api"], (number, env, answers)


@pytest.mark.parametrize("how", ["json", "gzip", "list", "list-gzip"])
def test_both_servers_serve_integers_in_float_fields_as_floats(
    run_api: ServerProcess, ours: ServerProcess, how: str
) -> None:
    """JSON integers in scores and per-token logprobs or advantages come back from /batch as floats, by both."""
    both = _both({"run-api": run_api.url, "ours": ours.url})
    both("POST", "/register", json=ATROPOS_REGISTRATION)
    both("GET", "/batch")
    both("POST", "/register-env", json=atropos_register_env(4))
    integers = make_group(uid="ints")
    integers["scores"] = [1, 0, -1, 10**20]
    integers["inference_logprobs"] = [[0] * len(seq) for seq in integers["tokens"]]
    integers["advantages"] = [[1] * len(seq) for seq in integers["tokens"]]
    for group in (integers, make_group(uid="floats")):
        _post(both, [group], how)
    batches = both("GET", "/batch")
    served = {}
    for name, (status, body) in batches.items():
        assert status == 200 and len(body["batch"]) == 2, (name, body)
        values = [x for g in body["batch"] for field in ("scores", "inference_logprobs", "advantages")
                  for x in _flat(g[field])]
        assert values and all(type(x) is float for x in values), name
        served[name] = sorted(values)
    assert served["ours"] == served["run-api"]


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [x for item in value for x in _flat(item)]
    return [] if value is None else [value]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), max_size=12), st.integers(1, 12))
def test_run_api_buffer_release_is_atropos_own(sizes: list[int], target: int) -> None:
    """The groups /status-env takes run-api to release from its buffer are the ones run-api's own code picks."""
    from atroposlib.api.utils import find_groups_summing_to_target

    assert runapi_buffer_release(sizes, target) == find_groups_summing_to_target(
        [{"tokens": [[0]] * n} for n in sizes], target
    )
