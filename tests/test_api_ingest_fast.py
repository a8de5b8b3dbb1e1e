"""The fast reading of posted groups (msgspec) accepts exactly what the pydantic model accepts,
and stores what the pydantic path would have stored (the same JSON values, with their types).

`ScoredGroup` (pydantic) is the reference: a body it refuses must be refused, and a body it
accepts must be queued as `pydantic_core.to_json(ScoredGroup)` would write it, up to formatting.
"""

from __future__ import annotations

import copy
import gzip
import json
import math

import pydantic
import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import (
    FMT_GZIP_LIST1,
    FMT_GZIP_OBJECT,
    IngestContext,
    check_group,
    decode_payload,
    prepare_groups,
)
from blackjack_rl.api.models import SCORED_DATA_FIELDS, ScoredGroup

CTX = IngestContext(batch_size=8, max_token_len=4096, env_group_sizes={0: 4})


def group(**changes):
    g = {
        "tokens": [[5, 6, 7, 8], [5, 6, 9, 10]],
        "masks": [[-100, -100, 7, 8], [-100, -100, 9, 10]],
        "scores": [1.0, -1.0],
        "inference_logprobs": [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, -1e-05, -2.5]],
        "messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}]],
        "env_id": 0,
        "episodes": [{"seed": 3, "note": "unknown fields are kept"}, {"seed": 3}],
    }
    g.update(changes)
    return {k: v for k, v in g.items() if v is not _DROP}


_DROP = object()


def _typed(value):
    """A JSON value with its number types made visible (1 and 1.0 differ), NaN-safe."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def _stored(body: bytes, coding: str, as_list: bool):
    return [_typed(json.loads(decode_payload(g.fmt, g.data, g.suffix)))
            for g in prepare_groups(body, coding, CTX, as_list=as_list, max_bytes=10**7)]


def _reference(text: bytes, as_list: bool):
    """What the pydantic model makes of the body: every group as its to_json, every Atropos field present."""
    groups = (pydantic.TypeAdapter(list[ScoredGroup]).validate_json(text) if as_list
              else [ScoredGroup.model_validate_json(text)])
    return [_typed({**dict.fromkeys(SCORED_DATA_FIELDS), **json.loads(pydantic_core.to_json(g))}) for g in groups]


CASES = {
    "plain": group(),
    "optional fields left out": group(inference_logprobs=_DROP, messages=_DROP, env_id=_DROP),
    "explicit nulls": group(inference_logprobs=None, advantages=None, env_id=None),
    "integers in float fields": group(scores=[1, -1]),
    "integers in per-token floats": group(inference_logprobs=[[1, 1, 0, 0], [1, 1, -1, 0]]),
    "atropos' empty lists": group(advantages=[], ref_logprobs=[], overrides=[], images=[]),
    "free-form fields": group(generation_params={"temperature": 0.7, "stop": ["x"]}, group_overrides={"a": 1}),
    "per-token advantages": group(advantages=[[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, -0.5, -0.5]]),
    "a field of the environment's own": group(trace={"step": 1, "values": [0.5, -2]}),
    "no episodes metadata": group(episodes=_DROP),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("coding", ["identity", "gzip"])
@pytest.mark.parametrize("as_list", [False, True])
def test_accepted_groups_are_stored_as_the_model_writes_them(name, coding, as_list):
    g = CASES[name]
    text = json.dumps([g, g] if as_list else g).encode()
    body = gzip.compress(text) if coding == "gzip" else text
    assert _stored(body, coding, as_list) == _reference(text, as_list)


def test_nan_in_a_free_form_field_is_stored_as_null():
    text = json.dumps(group()).replace('"note": "unknown fields are kept"', '"note": NaN').encode()
    (stored,) = _stored(text, "identity", False)
    assert stored["episodes"][0]["note"] == ("NoneType", None)


@pytest.mark.parametrize("where", ["episodes", "trace"])
@pytest.mark.parametrize("as_list", [False, True])
def test_numbers_too_big_for_a_float_outside_the_checked_fields(where, as_list):
    """1e999 is valid JSON that parses to infinity: stored as the model writes it (null), in
    our metadata (read in the single pass) and in a field of the client's own (read apart)."""
    g = group(trace={"x": 0.5}) if where == "trace" else group()
    text = json.dumps([g] if as_list else g).encode()
    inner = b'"x": 0.5' if where == "trace" else b'"seed": 3}]'
    text = text.replace(inner, inner.replace(b"0.5", b"1e999").replace(b"3}]", b'3, "big": -1e999}]'))
    assert b"1e999" in text
    assert _stored(text, "identity", as_list) == _reference(text, as_list)


BAD = {
    "a float token": group(tokens=[[5, 6, 7.0, 8], [5, 6, 9, 10]]),
    "a string token": group(tokens=[[5, 6, "7", 8], [5, 6, 9, 10]]),
    "a boolean token": group(tokens=[[5, 6, True, 8], [5, 6, 9, 10]]),
    "a negative token": group(tokens=[[5, 6, -7, 8], [5, 6, 9, 10]]),
    "a token of 2**31": group(tokens=[[5, 6, 2**31, 8], [5, 6, 9, 10]]),
    "a boolean mask": group(masks=[[-100, -100, True, 8], [-100, -100, 9, 10]]),
    "a string score": group(scores=["1", -1.0]),
    "a boolean score": group(scores=[True, -1.0]),
    "null tokens": group(tokens=None),
    "no scores": group(scores=_DROP),
    "a message without content": group(messages=[[{"role": "user"}], [{"role": "user", "content": "x"}]]),
    "env_id as a float": group(env_id=0.0),
    "env_id negative": group(env_id=-1),
    "tokens not a list of lists": group(tokens=[5, 6]),
    "generation_params a list": group(generation_params=[1]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_what_the_model_refuses_is_refused_with_its_message(name):
    text = json.dumps(BAD[name]).encode()
    with pytest.raises(pydantic.ValidationError):
        ScoredGroup.model_validate_json(text)
    with pytest.raises(ApiError) as refused:
        prepare_groups(text, "identity", CTX, as_list=False, max_bytes=10**7)
    assert refused.value.status in (400, 422)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(list(SCORED_DATA_FIELDS) + ["episodes"]), value=JSON,
       as_list=st.booleans())
def test_any_value_in_any_field_gets_the_models_answer(field, value, as_list):
    """Replace one field by arbitrary JSON: refused exactly when the model refuses it, else stored as it writes it."""
    g = copy.deepcopy(group())
    g[field] = value
    text = json.dumps([g] if as_list else g).encode()
    try:
        reference = _reference(text, as_list)
    except pydantic.ValidationError:
        with pytest.raises(ApiError):
            prepare_groups(text, "identity", CTX, as_list=as_list, max_bytes=10**7)
        return
    try:
        stored = _stored(text, "identity", as_list)
    except ApiError as exc:  # refused by a cross-field rule (shapes, sizes): the model's group is refused too
        assert exc.status == 422
        groups = (pydantic.TypeAdapter(list[ScoredGroup]).validate_json(text) if as_list
                  else [ScoredGroup.model_validate_json(text)])
        with pytest.raises(ApiError):
            for g in groups:
                check_group(g, CTX)
        return
    assert stored == reference


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("drop", [(), ("env_id", "messages")])
def test_a_gzip_body_with_whitespace_is_served_as_its_group(as_list, drop):
    """A body stored as the client's own gzip bytes is served as exactly its group's JSON object,
    whatever whitespace the client put around it, with the fields it left out added as null."""
    g = group(**dict.fromkeys(drop, _DROP))
    inner = json.dumps(g, indent=1).encode()
    text = b"\n [\r\n\t" + inner + b" \n] \n" if as_list else b" \r\n" + inner + b"\n\t "
    (prepared,) = prepare_groups(gzip.compress(text), "gzip", CTX, as_list=as_list, max_bytes=10**7)
    assert prepared.fmt == (FMT_GZIP_LIST1 if as_list else FMT_GZIP_OBJECT)  # kept as the client's bytes
    served = decode_payload(prepared.fmt, prepared.data, prepared.suffix)
    assert served.startswith(b"{") and served.endswith(b"}")
    assert json.loads(served) == {**dict.fromkeys(SCORED_DATA_FIELDS), **g}


@pytest.mark.parametrize("field", ["episodes", "images", "generation_params", "trace"])
@pytest.mark.parametrize("depth", [150, 200, 201, 1000, 100_000])
def test_deeply_nested_values_get_the_models_answer(field, depth):
    """Nesting is bounded by pydantic's JSON reader (~200 levels): below it the group is stored
    as the model writes it, above it the body is refused as invalid JSON, never a crash."""
    nested = ("[" * depth + "]" * depth) if field != "generation_params" else ('{"a":' * depth + "1" + "}" * depth)
    text = json.dumps(group(**{field: None}))[:-1].replace(f'"{field}": null', f'"{field}": {nested}') + "}"
    text = text.encode()
    try:
        reference = _reference(text, False)
    except pydantic.ValidationError:
        with pytest.raises(ApiError) as refused:
            prepare_groups(text, "identity", CTX, as_list=False, max_bytes=10**7)
        assert refused.value.status == 400 and "recursion" in refused.value.detail
        return
    assert _stored(text, "identity", False) == reference


ROW_B = "[1.0, 1.0, -1.5e-05, -2.5]"
LOGPROB_TEXTS = {  # the text of inference_logprobs, and whether it is checked on its text alone
    "plain": (f"[[1.0, 1.0, -0.5, -0.25], {ROW_B}]", True),
    "compact, capital exponent": ("[[1.0,1.0,-0.5,-0.25],[1.0,1.0,-1.5E-05,-2.5]]", True),
    "spaces and newlines": (f"[ [ 1.0 , 1.0 , -0.5 , -0.25 ] ,\n {ROW_B} ]", True),
    "negative zero, exponents": (f"[[-0.0, 2.5e-3, -5.0E-1, 1.5], {ROW_B}]", True),
    "floats without a point": (f"[[-0.0, 2e-3, -5E-1, 1.5], {ROW_B}]", False),
    "an integer": (f"[[1.0, 1, -0.5, -0.25], {ROW_B}]", False),
    "an integer first": (f"[[1, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "an integer last": (f"[[1.0, 1.0, -0.5, 0], {ROW_B}]", False),
    "a row of one integer": ("[[1], [2]]", False),
    "a positive exponent": (f"[[1e5, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "a signed positive exponent": (f"[[1.5e+300, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "beyond a double": (f"[[1e999, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "beyond a double in digits": (f"[[1{'0' * 400}.0, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "many digits, finite": (f"[[0.{'0' * 400}1, 1.0, -0.5, -0.25], {ROW_B}]", False),
    "a short row": (f"[[1.0, 1.0, -0.5], {ROW_B}]", False),
    "a long row": (f"[[1.0, 1.0, -0.5, -0.25, 0.5], {ROW_B}]", False),
    "an empty row": ("[[1.0, 1.0, -0.5, -0.25], []]", False),
    "one row for two sequences": ("[[1.0, 1.0, -0.5, -0.25]]", False),
    "three rows": (f"[[1.0, 1.0, -0.5, -0.25], {ROW_B}, {ROW_B}]", False),
    "nested deeper": (f"[[[1.0], 1.0, -0.5, -0.25], {ROW_B}]", False),
    "a string": (f'[[1.0, 1.0, -0.5, "-0.25"], {ROW_B}]', False),
    "null in a row": (f"[[1.0, 1.0, -0.5, null], {ROW_B}]", False),
    "true in a row": (f"[[1.0, 1.0, -0.5, true], {ROW_B}]", False),
    "an object": (f'[{{"a": 1.0}}, {ROW_B}]', False),
    "rows not in a list": (f"{ROW_B}", False),
    "empty: absent": ("[]", False),
    "null": ("null", False),
}


@pytest.mark.parametrize("name", list(LOGPROB_TEXTS))
@pytest.mark.parametrize("as_list", [False, True])
def test_logprobs_checked_on_their_text_get_the_models_answer(name, as_list):
    """inference_logprobs is checked on its JSON text when it is rows of floats: every text,
    taken that way or read number by number, is refused or stored exactly as the model does."""
    from blackjack_rl.api.ingest import float_rows_checked

    logprobs, on_text = LOGPROB_TEXTS[name]
    marker = '"inference_logprobs": "HERE"'
    g = json.dumps(group(inference_logprobs="HERE"))
    text = g.replace(marker, f'"inference_logprobs": {logprobs}').encode()
    if as_list:
        text = b"[" + text + b"]"
    assert float_rows_checked(logprobs.encode(), group()["tokens"]) is on_text
    try:
        reference = _reference(text, as_list)
    except pydantic.ValidationError:
        with pytest.raises(ApiError):
            prepare_groups(text, "identity", CTX, as_list=as_list, max_bytes=10**7)
        return
    try:
        stored = _stored(text, "identity", as_list)
    except ApiError as exc:
        assert exc.status == 422
        groups = (pydantic.TypeAdapter(list[ScoredGroup]).validate_json(text) if as_list
                  else [ScoredGroup.model_validate_json(text)])
        with pytest.raises(ApiError):
            for g in groups:
                check_group(g, CTX)
        return
    assert stored == reference
    for body, coding in ((text, "identity"), (gzip.compress(text), "gzip")):
        assert _stored(body, coding, as_list) == reference


PER_TOKEN = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 3) | st.sampled_from(
    [1e300, -1e-300, 1e16, 0.0, -0.0, 5e-324, 1.7976931348623157e308])


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.lists(PER_TOKEN, min_size=3, max_size=5), min_size=1, max_size=3),
       compact=st.booleans(), as_list=st.booleans())
def test_any_per_token_floats_get_the_models_answer(rows, compact, as_list):
    g = group(inference_logprobs=rows)
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps([g] if as_list else g, separators=separators).encode()
    try:
        reference = _reference(text, as_list)
    except pydantic.ValidationError:
        with pytest.raises(ApiError):
            prepare_groups(text, "identity", CTX, as_list=as_list, max_bytes=10**7)
        return
    shapes_fit = len(rows) == 2 and all(len(r) == 4 for r in rows)
    if not shapes_fit:
        with pytest.raises(ApiError) as refused:
            _stored(text, "identity", as_list)
        assert refused.value.status == 422
        return
    assert _stored(text, "identity", as_list) == reference
