"""Strict input: every malformed post gets a 4xx naming the problem, and valid groups still batch."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_payloads import ATROPOS_REGISTRATION, atropos_register_env, make_group, uids
from fastapi.testclient import TestClient

from blackjack_rl.api import ApiConfig, create_app


def started_client(tmp_path: Path, **config: Any) -> TestClient:
    app = create_app(ApiConfig(db_path=tmp_path / "api.sqlite", **config))
    return TestClient(app)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    """A running app with a trainer (batches of 8) that has started, and env 0 (groups of 4)."""
    with started_client(tmp_path, max_body_bytes=256 * 1024) as client:
        assert client.post("/register", json=ATROPOS_REGISTRATION).status_code == 200
        assert client.get("/batch").json()["batch"] is None
        assert client.post("/register-env", json=atropos_register_env(4)).json()["env_id"] == 0
        yield client


def post(client: TestClient, group: dict[str, Any]) -> Any:
    return client.post("/scored_data", json=group)


def bad(client: TestClient, group: dict[str, Any], *needles: str, status: int = 422) -> str:
    response = post(client, group)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    for needle in needles:
        assert needle in detail, detail
    return str(detail)


def with_seq(group: dict[str, Any], key: str, index: int, value: Any) -> dict[str, Any]:
    changed = json.loads(json.dumps(group))
    changed[key][index] = value
    return changed


def test_lengths_must_agree(api: TestClient) -> None:
    g = make_group()
    bad(api, {**g, "masks": g["masks"][:3]}, "masks has 3 entries", "4 sequences")
    bad(api, {**g, "scores": g["scores"][:3]}, "scores has 3 entries")
    bad(api, with_seq(g, "masks", 1, g["masks"][1][:-1]), "masks[1] has 11 positions", "tokens[1] has 12")
    bad(api, with_seq(g, "inference_logprobs", 2, [0.0]), "inference_logprobs[2] has 1 positions")
    bad(api, {**g, "inference_logprobs": g["inference_logprobs"][:1]}, "inference_logprobs has 1 entries")
    bad(api, {**g, "ref_logprobs": [[0.0]] * 4}, "ref_logprobs[0] has 1 positions")
    bad(api, {**g, "advantages": [[0.0] * 12]}, "advantages has 1 entries")
    bad(api, {**g, "overrides": [{}]}, "overrides has 1 entries")
    bad(api, with_seq(g, "tokens", 0, []), "tokens[0] is empty")


@pytest.mark.parametrize("score", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_scores_must_be_finite(api: TestClient, score: str) -> None:
    body = json.dumps(make_group()).replace('"scores": [-1.0', f'"scores": [{score}')
    response = api.post("/scored_data", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert "scores[0]" in response.json()["detail"] and "finite" in response.json()["detail"]


@pytest.mark.parametrize("score", ['"1.0"', "true", "null", "[1]", '{"a": 1}'])
def test_scores_must_be_numbers(api: TestClient, score: str) -> None:
    body = json.dumps(make_group()).replace('"scores": [-1.0', f'"scores": [{score}')
    response = api.post("/scored_data", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert "scores[0]" in response.json()["detail"] and "valid number" in response.json()["detail"]


def test_logprobs_must_be_finite(api: TestClient) -> None:
    body = json.dumps(make_group()).replace('"inference_logprobs": [[1.0', '"inference_logprobs": [[NaN')
    response = api.post("/scored_data", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert "inference_logprobs[0][0] is nan" in response.json()["detail"]


def test_masks_are_minus_100_or_the_token(api: TestClient) -> None:
    g = make_group()
    wrong = with_seq(g, "masks", 2, list(g["masks"][2]))
    wrong["masks"][2][7] = 999
    detail = bad(api, wrong, "masks[2][7] is 999", "-100")
    assert f"({g['tokens'][2][7]})" in detail
    interleaved = with_seq(g, "masks", 0, list(g["tokens"][0]))
    interleaved["masks"][0][6] = -100  # multi-turn masks are fine
    assert post(api, interleaved).status_code == 200


def test_token_ids_are_non_negative_integers(api: TestClient) -> None:
    g = make_group()
    neg = with_seq(g, "tokens", 1, [-3] + g["tokens"][1][1:])
    bad(api, neg, "tokens[1][0]", "token ids must be integers from 0")
    flt = json.dumps(g).replace('"tokens": [[1,', '"tokens": [[1.5,')
    response = api.post("/scored_data", content=flt, headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and "tokens[0][0]" in response.json()["detail"]
    bad(api, with_seq(g, "tokens", 0, ["1"] * 12), "tokens[0][0]", "valid integer")


def test_group_size_must_fit_batches_and_the_environment(api: TestClient) -> None:
    g = make_group(n=4)
    bad(api, make_group(n=16), "16 sequences", "batches hold 8", "never be placed")
    bad(api, make_group(n=3), "3 sequences", "must divide 8", "1, 2, 4, 8")
    bad(api, make_group(n=8), "env 0 registered group_size 4", 'group_overrides {"group_size": 8}')
    declared = {**make_group(n=8), "group_overrides": {"group_size": 8}}
    assert post(api, declared).status_code == 200
    assert post(api, make_group(n=2)).status_code == 200  # smaller than registered: fine
    assert post(api, {**g, "env_id": None}).status_code == 200  # anonymous, as Atropos allows


def test_unknown_env_id(api: TestClient) -> None:
    bad(api, make_group(env_id=7), "env_id 7 is not registered", "known: 0", "/register-env")
    assert api.get("/status-env", params={"env_id": 7}).status_code == 404
    assert api.post("/disconnect-env", json={"env_id": 7}).status_code == 404


def test_registering_an_environment_whose_groups_cannot_pack(api: TestClient) -> None:
    response = api.post("/register-env", json=atropos_register_env(3))
    assert response.status_code == 422
    assert "group_size 3" in response.json()["detail"] and "1, 2, 4, 8" in response.json()["detail"]


def test_too_long_sequences_are_refused(api: TestClient) -> None:
    bad(api, make_group(length=600), "tokens[0] has 600 tokens", "max_token_len 512")


def test_malformed_bodies(api: TestClient) -> None:
    h = {"Content-Type": "application/json"}
    r = api.post("/scored_data", content=b'{"tokens": [[1]', headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = api.post("/scored_data_list", content=json.dumps(make_group()), headers=h)
    assert r.status_code == 422 and "expected a JSON list of groups" in r.json()["detail"]
    r = api.post("/scored_data", content=b"[]", headers=h)
    assert r.status_code == 422 and "expected a JSON object" in r.json()["detail"]
    r = api.post("/scored_data", json={"masks": [[1]], "scores": [1]})
    assert r.status_code == 422 and "tokens: Field required" in r.json()["detail"]
    r = api.post("/scored_data", json={**make_group(), "messages": [[{"role": "user"}]] * 4})
    assert r.status_code == 422 and "messages[0][0] needs both 'role' and 'content'" in r.json()["detail"]
    r = api.post("/scored_data", content=b"x" * 10, headers={**h, "Content-Encoding": "br"})
    assert r.status_code == 415 and "gzip" in r.json()["detail"]
    r = api.post("/scored_data", content=b"not gzip at all", headers={**h, "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip" in r.json()["detail"]
    truncated = gzip.compress(json.dumps(make_group()).encode())[:-20]
    r = api.post("/scored_data", content=truncated, headers={**h, "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["detail"]


def test_a_bad_group_in_a_list_refuses_the_list_and_names_it(api: TestClient) -> None:
    groups = [make_group(uid="a"), {**make_group(uid="b"), "scores": [1.0]}, make_group(uid="c")]
    r = api.post("/scored_data_list", json=groups)
    assert r.status_code == 422 and r.json()["detail"].startswith("group 1: scores has 1 entries")
    assert api.get("/status").json()["queue_size"] == 0  # all or nothing


def test_body_size_limit(api: TestClient) -> None:
    big = [make_group(uid=str(i), length=400) for i in range(40)]
    r = api.post("/scored_data_list", json=big)
    assert r.status_code == 413 and "limit of 262144 bytes" in r.json()["detail"]


def test_gzip_bomb_is_refused_without_inflating_it(api: TestClient) -> None:
    bomb = gzip.compress(b"[" + b" " * (64 * 1024 * 1024) + b"]", compresslevel=9)
    assert len(bomb) < 100_000
    r = api.post("/scored_data_list", content=bomb,
                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed body exceeds" in r.json()["detail"]
    zlib_stream = zlib.compress(json.dumps(make_group()).encode())
    r = api.post("/scored_data", content=zlib_stream,
                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 400


def test_after_every_rejection_valid_groups_still_batch(api: TestClient) -> None:
    g = make_group()
    rejected = [
        {**g, "scores": [1.0]},
        make_group(n=16),
        make_group(n=3),
        make_group(env_id=5),
        with_seq(g, "tokens", 0, [-1] * 12),
    ]
    for i, group in enumerate(rejected):
        assert post(api, group).status_code in (400, 413, 422)
        assert post(api, make_group(uid=f"ok{i}")).status_code == 200
    batches = []
    while (b := api.get("/batch").json())["batch"] is not None:
        batches.append(uids(b["batch"]))
        assert sum(len(x["tokens"]) for x in b["batch"]) == 8
    assert [u for b in batches for u in b] == [f"ok{i}" for i in range(4)]  # ok4 waits for a partner
