"""Checking posted groups and turning them into the compressed blobs the queue stores.

Everything here is pure (bytes and a context in, prepared groups or an ApiError out), so
it can be tested without a server and run wherever the server likes.

Validation is one typed pass of msgspec (C) over the JSON, plus C-speed list comparisons
for the cross-field rules; no per-token Python loop runs for valid groups. A body msgspec
refuses, or one that needs more than checking (integers in float fields, NaN in free-form
fields), is read again by pydantic-core, whose model is the authority for error messages and
for re-encoding: the fast path only ever accepts what that model accepts.
Storage avoids re-encoding where it can: a group that arrived as one gzip stream is stored
as the client's own compressed bytes, and any other group as its own JSON text, so ingest
costs a parse and a check, not a re-encode.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pydantic_core
from pydantic import TypeAdapter, ValidationError

from blackjack_rl.contract.tokens import MASKED
from blackjack_rl.api.batching import divisors_text
from blackjack_rl.api.body import fast_zlib, gunzip_limited
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.models import (
    FLOAT_FIELDS,
    INTEGERS_SEEN,
    SCORED_DATA_FIELDS,
    FastKnownGroup,
    FastScoredGroup,
    ScoredGroup,
    holds_int,
)

#: How a stored payload is encoded.
FMT_ZLIB = 1  # zlib-compressed JSON object
FMT_GZIP_OBJECT = 2  # the client's gzip body, a JSON object
FMT_GZIP_LIST1 = 3  # the client's gzip body, a JSON list holding one object

#: Groups in one /scored_data_list post: queueing them is one transaction that other writers wait for.
MAX_GROUPS_PER_POST = 4096
_GROUP_LIST = TypeAdapter(list[ScoredGroup])
_FAST_GROUP = msgspec.json.Decoder(FastScoredGroup)
_KNOWN_GROUP = msgspec.json.Decoder(FastKnownGroup)
_KNOWN_LIST = msgspec.json.Decoder(list[FastKnownGroup])
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_FLOAT_ROWS = msgspec.json.Decoder(list[list[int | float]] | None)
_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()
_KNOWN_FIELDS = frozenset(SCORED_DATA_FIELDS)
_LOOSE_FIELDS = ("messages", "generation_params", "overrides", "group_overrides", "images")
_SHOWN_ERRORS = 4
#: Free-form values nested deeper than this are read by pydantic (which allows ~200 levels).
_FAST_DEPTH = 100


@dataclass(frozen=True)
class IngestContext:
    """What validation needs to know about the run, as a snapshot taken before validating."""

    batch_size: int | None  # None until a trainer registers
    max_token_len: int = -1
    env_group_sizes: Mapping[int, int] = field(default_factory=dict)
    generation: int = 0  # changes when registrations change; the store re-checks it


@dataclass(frozen=True)
class PreparedGroup:
    """A validated group, ready to be queued."""

    env_id: int | None
    n_seq: int
    fmt: int
    data: bytes
    suffix: bytes = b""  # `,"key":null` pairs for Atropos fields the client left out


def prepare_groups(
    raw: bytes, coding: str, ctx: IngestContext, *, as_list: bool, max_bytes: int
) -> list[PreparedGroup]:
    """Validate a /scored_data (one group) or /scored_data_list (a list) body.

    All or nothing: one bad group refuses the whole request, with a message naming it, so a
    client never has to work out which part of a post was queued.
    """
    if ctx.batch_size is None:
        raise ApiError(
            503,
            "no trainer has registered yet (POST /register); groups are accepted once a trainer "
            "has said how many sequences its batches hold",
        )
    members = 0
    text = raw
    if coding == "gzip":
        text, members = gunzip_limited(raw, max_bytes)
    fast = _fast_parse(text, as_list)
    if fast is not None:
        # msgspec refuses NaN, Infinity and numbers beyond a double's range: nothing to look for.
        _check_all([g for g, _, _ in fast], ctx, as_list, finite=True)
        if len(fast) == 1 and coding == "gzip" and members == 1:
            group, _, suffix = fast[0]
            fmt = FMT_GZIP_LIST1 if as_list else FMT_GZIP_OBJECT
            return [PreparedGroup(group.env_id, len(group.tokens), fmt, raw, suffix)]
        texts = [own for _, own, _ in fast]
        if None in texts:
            texts = _group_texts(text, as_list)
        return [PreparedGroup(g.env_id, len(g.tokens), FMT_ZLIB, zlib.compress(own, 1), suffix)
                for (g, _, suffix), own in zip(fast, texts)]

    seen: dict[str, bool] = {}
    groups = _parse(text, as_list, seen)
    _check_all(groups, ctx, as_list)

    # Stored as sent only when sending it back unchanged is right: integers in float fields
    # become floats, NaN in unchecked fields becomes null, both by re-encoding.
    if len(groups) == 1 and not seen.get(INTEGERS_SEEN) and not _unvalidated_non_finite(groups[0]):
        group = groups[0]
        suffix = _missing_fields_suffix(group)
        if coding == "gzip" and members == 1:
            fmt = FMT_GZIP_LIST1 if as_list else FMT_GZIP_OBJECT
            return [PreparedGroup(group.env_id, len(group.tokens), fmt, raw, suffix)]
        own_text = _object_text(text, as_list)
        if own_text is not None:
            return [PreparedGroup(group.env_id, len(group.tokens), FMT_ZLIB, zlib.compress(own_text, 1), suffix)]
    return [
        PreparedGroup(g.env_id, len(g.tokens), FMT_ZLIB, zlib.compress(pydantic_core.to_json(g), 1))
        for g in groups
    ]


def decode_payload(fmt: int, data: bytes, suffix: bytes = b"") -> bytes:
    """The JSON object of a stored group, every Atropos field present."""
    return b"".join(payload_parts(fmt, data, suffix))


def payload_parts(fmt: int, data: bytes, suffix: bytes = b"") -> list[bytes | memoryview]:
    """`decode_payload` as pieces to join, without copying the decompressed text again
    (a batch joins sixteen of these, ~100 KB each, into its body)."""
    if fmt == FMT_ZLIB:
        text = _inflate(data, zlib.MAX_WBITS)
        start, end = 0, len(text)
    elif fmt in (FMT_GZIP_OBJECT, FMT_GZIP_LIST1):
        text = _inflate(data, 16 + zlib.MAX_WBITS)
        start, end = _strip(text, 0, len(text))
        if fmt == FMT_GZIP_LIST1:  # the client's `[ {...} ]`
            start, end = _strip(text, start + 1, end - 1)
    else:
        raise ValueError(f"unknown payload format {fmt}")
    view = memoryview(text)[start:end]
    return [view[:-1], suffix, b"}"] if suffix else [view]


def _inflate(data: bytes, wbits: int) -> bytes:
    """A stored payload decompressed: by ISA-L when it is one complete stream, as stored payloads
    are (checked when posted), else by the stdlib (zero padding after a client's stream, or a
    payload the stdlib should name the problem of)."""
    if fast_zlib is not None:
        decoder = fast_zlib.decompressobj(wbits)
        try:
            text: bytes = decoder.decompress(data)
        except Exception:  # noqa: BLE001 - isal's own error type
            pass
        else:
            if decoder.eof and not decoder.unused_data:
                return text
    return zlib.decompress(data, wbits)


def _strip(text: bytes, start: int, end: int) -> tuple[int, int]:
    """The bounds of text[start:end] without JSON whitespace at either end."""
    while start < end and text[start] in b" \t\r\n":
        start += 1
    while end > start and text[end - 1] in b" \t\r\n":
        end -= 1
    return start, end


def _check_all(groups: Sequence[Any], ctx: IngestContext, as_list: bool, finite: bool = False) -> None:
    if len(groups) > MAX_GROUPS_PER_POST:
        raise ApiError(
            413,
            f"this post holds {len(groups)} groups; send at most {MAX_GROUPS_PER_POST} per post "
            "(each is a row written while other posts wait)",
        )
    for index, group in enumerate(groups):
        try:
            check_group(group, ctx, finite=finite)
        except ApiError as exc:
            if as_list:
                exc.detail = f"group {index}: {exc.detail}"
            raise


# --- parsing -----------------------------------------------------------------------------


def _fast_parse(text: bytes, as_list: bool) -> list[tuple[FastScoredGroup, bytes | None, bytes]] | None:
    """Each group, read by msgspec, with its own JSON text (None: not cut out yet) and the
    `,"key":null` pairs for the Atropos fields that text leaves out; None sends the body to pydantic.

    None whenever the pydantic path could answer differently: a body msgspec refuses (pydantic
    then names the problem), JSON integers in float fields (re-encoded as floats), NaN or
    infinity outside the checked fields (re-encoded as null), messages without role/content.
    The usual body, groups of known fields only, takes one typed pass over the JSON.
    """
    try:
        known = _KNOWN_LIST.decode(text) if as_list else [_KNOWN_GROUP.decode(text)]
    except RecursionError:  # nested deeper than pydantic reads either: it names the problem
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _fast_parse_fields(text, as_list)  # another field, or a body pydantic must read
    out: list[tuple[FastScoredGroup, bytes | None, bytes]] = []
    for group in known:
        missing = [name for name in SCORED_DATA_FIELDS if getattr(group, name) is msgspec.UNSET]
        if group.inference_logprobs is not msgspec.UNSET:
            text_of = bytes(group.inference_logprobs)
            if float_rows_checked(text_of, group.tokens):
                # Checked here: shapes and values. None keeps check_group and _plain off it.
                group = msgspec.structs.replace(group, inference_logprobs=None)
            else:
                try:
                    rows = _FLOAT_ROWS.decode(text_of)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                    return None  # pydantic names the problem
                group = msgspec.structs.replace(group, inference_logprobs=rows)
        if not _plain(group, () if group.episodes is msgspec.UNSET else (group.episodes,)):
            return None
        out.append(_completed(group, missing, None))
    return out


#: JSON whitespace and what a number is made of but its decimal point: deleted, they leave a
#: float field's shape.
_NOT_SHAPE = b"0123456789-+eE \t\r\n"
_SHAPE_TEXT = b"[],."
_DIGITS_AS_D = bytes.maketrans(b"0123456789", b"d" * 10)
#: 309 digits in a row may not fit a double.
_LONG_DIGITS = b"d" * 309


def float_rows_checked(text: bytes, tokens: list[list[int]]) -> bool:
    """Whether `text`, the JSON of a per-token float field, is one row per sequence of
    `tokens`, each of as many numbers as its sequence has tokens, every one written with a
    decimal point (so none is a JSON integer, which must come back as a float) and within a
    double's range. False says nothing is wrong, only that the field must be read number by
    number (as every other float field is); so does a float written without a point (`1e-05`).

    Deleting whitespace and all of each number but its point leaves the field's shape:
    `[[.,.,.],[.,.]]`. In valid JSON (msgspec has checked the syntax) a number holds one point
    at most, so a row with one point per token and one comma fewer holds no integer.
    """
    shape = text.translate(None, _NOT_SHAPE)
    if shape.translate(None, _SHAPE_TEXT) or not (shape.startswith(b"[[") and shape.endswith(b"]]")):
        return False  # strings, literals, objects: something other than numbers
    inner = shape[2:-2]
    rows = inner.split(b"],[")
    if len(rows) != len(tokens) or inner.count(b"[") != len(rows) - 1 or inner.count(b"]") != len(rows) - 1:
        return False  # another number of rows, or rows nested deeper
    lengths = [len(seq) for seq in tokens]
    if shape.count(b",") != sum(lengths) - 1 or [row.count(b".") for row in rows] != lengths:
        return False  # a number without a point, or rows of other lengths
    # Beyond a double's range only with a positive exponent or ~309 digits: logprobs have
    # neither, and a field that does is read number by number.
    for letter in (b"e", b"E"):
        at = text.find(letter)
        while at >= 0:
            if text[at + 1 : at + 2] != b"-":
                return False
            at = text.find(letter, at + 2)
    return _LONG_DIGITS not in text.translate(_DIGITS_AS_D)


def _fast_parse_fields(text: bytes, as_list: bool) -> list[tuple[FastScoredGroup, bytes | None, bytes]] | None:
    """`_fast_parse` for groups with fields of their own: each group's fields are read
    again as raw JSON, to find the missing ones and check the unknown ones' values."""
    try:
        out: list[tuple[FastScoredGroup, bytes | None, bytes]] = []
        for own in _group_texts(text, as_list):
            group = _FAST_GROUP.decode(own)
            fields = _RAW_FIELDS.decode(own)
            if not _plain(group, (_ANY.decode(value) for key, value in fields.items() if key not in _KNOWN_FIELDS)):
                return None
            out.append(_completed(group, [name for name in SCORED_DATA_FIELDS if name not in fields], own))
        return out
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _completed(
    group: FastScoredGroup, missing: list[str], own: bytes | None
) -> tuple[FastScoredGroup, bytes | None, bytes]:
    """A fast reading's entry: the fields left out set to None, and the pairs that add them as null."""
    return msgspec.structs.replace(group, **dict.fromkeys(missing)), own, _null_suffix(missing)


def _group_texts(text: bytes, as_list: bool) -> list[bytes]:
    """The JSON text of each group of a body msgspec has read."""
    return [bytes(r) for r in _RAW_LIST.decode(text)] if as_list else [text.strip()]


def _plain(group: FastScoredGroup, extra_values: Iterable[Any]) -> bool:
    """Whether storing this group as sent is exactly what the pydantic path would do."""
    if any(holds_int(getattr(group, name)) for name in FLOAT_FIELDS):
        return False
    messages = group.messages
    if isinstance(messages, list) and not all("role" in m and "content" in m for c in messages for m in c):
        return False
    if not all(_plain_value(getattr(group, name)) for name in _LOOSE_FIELDS):
        return False
    return all(_plain_value(value) for value in extra_values)


def _plain_value(value: Any, max_depth: int | None = _FAST_DEPTH) -> bool:
    """A free-form value with no NaN or infinity, nested no deeper than `max_depth`.

    On the fast path deeper values go to pydantic, which refuses JSON nested more than ~200
    levels; walked without recursion, so no depth a client sends can exhaust the stack.
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, (list, dict)):
            if max_depth is not None and depth >= max_depth:
                return False
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


def _parse(text: bytes, as_list: bool, context: dict[str, bool]) -> Sequence[ScoredGroup]:
    try:
        if as_list:
            return _GROUP_LIST.validate_json(text, context=context)
        return [ScoredGroup.model_validate_json(text, context=context)]
    except ValidationError as exc:
        raise _describe(exc, as_list) from None


def _describe(exc: ValidationError, as_list: bool) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        wanted = "a JSON list of groups" if as_list else "a JSON object (one group)"
        return ApiError(422, f"expected {wanted}, got {type(first['input']).__name__}")
    parts = []
    for error in errors[:_SHOWN_ERRORS]:
        loc = list(error["loc"])
        prefix = ""
        if as_list and loc and isinstance(loc[0], int):
            prefix = f"group {loc.pop(0)}: "
        text = error["msg"]
        if loc and loc[0] == "tokens" and error["type"] in ("greater_than_equal", "less_than"):
            text = "token ids must be integers from 0 to 2**31 - 1"
        message = f"{prefix}{_format_loc(loc)}: {text}"
        shown = error.get("input")
        if isinstance(shown, (int, float, str, bool)) or shown is None:
            if error["type"] != "missing":
                message += f" (got {_short_repr(shown)})"
        parts.append(message)
    if len(errors) > _SHOWN_ERRORS:
        parts.append(f"and {len(errors) - _SHOWN_ERRORS} more problems")
    return ApiError(422, "; ".join(parts))


def _format_loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- cross-field rules ---------------------------------------------------------------------


def check_group(group: ScoredGroup, ctx: IngestContext, *, finite: bool = False) -> None:
    """Shapes, masks, finiteness and size rules that a schema cannot express.

    `finite`: the parser already refused non-finite numbers, so they are not looked for.
    Raises ApiError(422) naming the first problem found.
    """
    tokens = group.tokens
    n = len(tokens)
    if n == 0:
        raise ApiError(422, "tokens is empty: a group needs at least one sequence")
    _same_count("masks", group.masks, n)
    _same_count("scores", group.scores, n)
    for i, (seq, mask) in enumerate(zip(tokens, group.masks)):
        if not seq:
            raise ApiError(422, f"tokens[{i}] is empty: every sequence needs at least one token")
        if len(mask) != len(seq):
            raise ApiError(422, f"masks[{i}] has {len(mask)} positions but tokens[{i}] has {len(seq)}")
        if mask != seq:
            _check_mask(i, seq, mask)
        if 0 < ctx.max_token_len < len(seq):
            raise ApiError(
                422,
                f"tokens[{i}] has {len(seq)} tokens, more than the trainer's max_token_len "
                f"{ctx.max_token_len}; drop or truncate it before sending",
            )
    if not finite:
        _check_finite("scores", group.scores)
    for name in ("inference_logprobs", "ref_logprobs", "advantages"):
        per_token = getattr(group, name)
        if per_token:  # atroposlib sends [] for "not provided"
            _same_count(name, per_token, n)
            for i, (values, seq) in enumerate(zip(per_token, tokens)):
                if len(values) != len(seq):
                    raise ApiError(422, f"{name}[{i}] has {len(values)} positions but tokens[{i}] has {len(seq)}")
                if not finite:
                    _check_finite(f"{name}[{i}]", values)
    for name in ("messages", "overrides"):
        per_sequence = getattr(group, name)
        if per_sequence:
            _same_count(name, per_sequence, n)
    _check_distill(group, n, finite)
    _check_size(group, n, ctx)


def _same_count(name: str, values: Sequence[Any], n: int) -> None:
    if len(values) != n:
        raise ApiError(422, f"{name} has {len(values)} entries but tokens has {n} sequences; they must match")


def _check_mask(i: int, seq: list[int], mask: list[int]) -> None:
    # Fast path for the usual shape: masked prompt, then the trained tokens themselves.
    # Token ids are >= 0, so if the tail after `masked` positions equals the tokens, all
    # the -100s are in the head, which is then entirely -100.
    masked = mask.count(MASKED)
    if mask[masked:] == seq[masked:]:
        return
    for j, (m, t) in enumerate(zip(mask, seq)):
        if m != MASKED and m != t:
            raise ApiError(
                422,
                f"masks[{i}][{j}] is {m}: a mask is -100 (not trained) or the token id at that position ({t})",
            )


def _check_finite(name: str, values: list[float]) -> None:
    # sum() runs in C; a NaN or infinity anywhere makes it non-finite. Only then look closer
    # (huge finite values can overflow the sum without being wrong).
    if math.isfinite(sum(values)):
        return
    for j, value in enumerate(values):
        if not math.isfinite(value):
            raise ApiError(422, f"{name}[{j}] is {value}: values must be finite numbers")


def _check_distill(group: ScoredGroup, n: int, finite: bool) -> None:
    ids, logprobs = group.distill_token_ids, group.distill_logprobs
    for name, values in (("distill_token_ids", ids), ("distill_logprobs", logprobs)):
        if values:
            _same_count(name, values, n)
            for i, (per_pos, seq) in enumerate(zip(values, group.tokens)):
                if len(per_pos) != len(seq):
                    raise ApiError(422, f"{name}[{i}] has {len(per_pos)} positions but tokens[{i}] has {len(seq)}")
    if ids and logprobs:
        for i, (a, b) in enumerate(zip(ids, logprobs)):
            if [len(x) for x in a] != [len(x) for x in b]:
                raise ApiError(422, f"distill_token_ids[{i}] and distill_logprobs[{i}] differ in shape")
    for i, per_pos in enumerate(() if finite else logprobs or ()):
        if not math.isfinite(sum(map(sum, per_pos))):  # one C-level pass per sequence
            for j, top in enumerate(per_pos):
                _check_finite(f"distill_logprobs[{i}][{j}]", top)


def _check_size(group: ScoredGroup, n: int, ctx: IngestContext) -> None:
    batch_size = ctx.batch_size
    assert batch_size is not None
    if n > batch_size:
        raise ApiError(
            422,
            f"group has {n} sequences but the trainer's batches hold {batch_size}: "
            "it could never be placed in a batch; split it",
        )
    if batch_size % n:
        raise ApiError(
            422,
            f"group has {n} sequences; batches hold exactly {batch_size}, so a group's size must "
            f"divide {batch_size} (one of {divisors_text(batch_size)})",
        )
    if group.env_id is None:
        return
    registered = ctx.env_group_sizes.get(group.env_id)
    if registered is None:
        raise ApiError(
            422,
            f"env_id {group.env_id} is not registered here (known: {known_envs_text(ctx.env_group_sizes)}); "
            "register with POST /register-env and send the env_id it returns",
        )
    if n > registered:
        declared = (group.group_overrides or {}).get("group_size")
        if declared != n:
            raise ApiError(
                422,
                f"group has {n} sequences but env {group.env_id} registered group_size {registered}; "
                f'send at most {registered}, or declare the larger group with group_overrides {{"group_size": {n}}}',
            )


def known_envs_text(env_ids: Iterable[int], shown: int = 10) -> str:
    """The registered env_ids for an error message, at most `shown` of them."""
    known = sorted(env_ids)
    if not known:
        return "none"
    if len(known) <= shown:
        return ", ".join(map(str, known))
    return ", ".join(map(str, known[:shown])) + f", ... ({len(known)} in all)"


# --- storage helpers ---------------------------------------------------------------------


def _unvalidated_non_finite(group: ScoredGroup) -> bool:
    """Whether a field that validation did not check for finiteness holds NaN or Infinity.

    Such a group is re-encoded rather than stored as sent, so trainers get standard JSON
    (null) instead of NaN, which strict JSON parsers refuse.
    """
    loose = [getattr(group, name) for name in _LOOSE_FIELDS] + [group.__pydantic_extra__]
    return not all(_plain_value(v, max_depth=None) for v in loose)  # pydantic has bounded the depth


def _object_text(text: bytes, as_list: bool) -> bytes | None:
    """The JSON text of the only group of a body, to store it as sent."""
    obj = text.strip()
    if as_list:
        obj = obj[1:-1].strip()
    if not (obj.startswith(b"{") and obj.endswith(b"}")):
        return None
    return obj


def _missing_fields_suffix(group: ScoredGroup) -> bytes:
    present = group.model_fields_set
    return _null_suffix(name for name in SCORED_DATA_FIELDS if name not in present)


def _null_suffix(missing: Iterable[str]) -> bytes:
    """`,"key":null` pairs that complete a stored group's JSON text with the fields it left out."""
    return b"".join(b',"%s":null' % name.encode() for name in missing)
