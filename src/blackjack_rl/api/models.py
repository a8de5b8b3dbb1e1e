"""Wire models: the request and response bodies of the Atropos trajectory API (atroposlib 0.4.0).

Field names are Atropos' own, so its trainers and environments work unchanged. Where Atropos
is lax we are strict about what would corrupt training (types, shapes, finiteness), and lax
about what it tolerates in practice (`wandb_group: null` from its example trainer, optional
fields sent as empty lists by its environments, fields left out of a registration), and
refuse `null` wherever Atropos' own server refuses it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Token ids are non-negative and fit in int32 (every tokenizer we know of); a strict int
# refuses 1.0, "1" and true, which would otherwise slip through as token 1.
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]
StrictInt = Annotated[int, Field(strict=True)]
# Strict floats accept JSON integers but not strings or booleans. NaN and Infinity parse
# (Python's json writes them) so that the validator can name them instead of failing to parse.
StrictFloat = Annotated[float, Field(strict=True)]

#: Every field of Atropos' ScoredData, in its order. /batch always returns all of them
#: (null when absent), as Atropos does, because trainers index them directly.
SCORED_DATA_FIELDS: tuple[str, ...] = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)

#: Fields of numbers that Atropos declares as floats.
FLOAT_FIELDS: tuple[str, ...] = ("scores", "advantages", "ref_logprobs", "inference_logprobs", "distill_logprobs")
#: Key set in the validation context when a float field held a JSON integer.
INTEGERS_SEEN = "integers_seen"


def holds_int(value: Any) -> bool:
    """Whether a (nested) list holds an int; `set(map(type, ...))` keeps the scan in C."""
    if not isinstance(value, list) or not value:
        return False
    kinds = set(map(type, value))
    if int in kinds:
        return True
    return list in kinds and any(holds_int(v) for v in value)


class ScoredGroup(BaseModel):
    """One group (GRPO: one prompt, several completions) as posted by an environment.

    Unknown keys (our `episodes` metadata, anything an environment adds) are kept and handed
    to the trainer untouched.
    """

    model_config = ConfigDict(extra="allow")

    tokens: list[list[TokenId]]
    masks: list[list[StrictInt]]
    scores: list[StrictFloat]
    advantages: list[list[StrictFloat]] | None = None
    ref_logprobs: list[list[StrictFloat]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[StrictFloat]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: Annotated[int, Field(strict=True, ge=0, lt=2**63)] | None = None
    distill_token_ids: list[list[list[TokenId]]] | None = None
    distill_logprobs: list[list[list[StrictFloat]]] | None = None

    @field_validator(*FLOAT_FIELDS, mode="before")
    @classmethod
    def _note_integers(cls, value: Any, info: ValidationInfo) -> Any:
        """Flag JSON integers in float fields (`[1, 0]`) in the validation context.

        The API stores a group as sent when it can; a flagged group is re-encoded instead, so
        trainers get `1.0` (as Atropos serves it) and never build an integer tensor.
        """
        context = info.context
        if isinstance(context, dict) and not context.get(INTEGERS_SEEN) and holds_int(value):
            context[INTEGERS_SEEN] = True
        return value

    @field_validator("messages")
    @classmethod
    def _messages_have_role_and_content(cls, value: list[list[dict[str, Any]]] | None) -> Any:
        if value is None:
            return None
        for i, conversation in enumerate(value):
            for j, message in enumerate(conversation):
                if "role" not in message or "content" not in message:
                    raise ValueError(f"messages[{i}][{j}] needs both 'role' and 'content'")
        return value


_MsTokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
_MsNumber = int | float  # ints kept apart: a group with JSON integers in float fields takes the pydantic path
_Unset = msgspec.UnsetType


class FastScoredGroup(msgspec.Struct, frozen=True):
    """The fast first reading of a posted group (msgspec: one typed pass in C).

    It accepts only what `ScoredGroup` accepts (strict ints, token ids in range, lists where
    lists belong), and a field left out stays UNSET, so the missing ones are known. Anything it
    refuses, or that needs more than checking (integers in float fields, NaN), is read again by
    `ScoredGroup`, which stays the one authority for error messages and for re-encoding.
    Unknown fields are skipped here; the group is stored as sent, so they are kept.
    """

    tokens: list[list[_MsTokenId]]
    masks: list[list[int]]
    scores: list[_MsNumber]
    advantages: list[list[_MsNumber]] | None | _Unset = msgspec.UNSET
    ref_logprobs: list[list[_MsNumber]] | None | _Unset = msgspec.UNSET
    messages: list[list[dict[str, Any]]] | None | _Unset = msgspec.UNSET
    generation_params: dict[str, Any] | None | _Unset = msgspec.UNSET
    inference_logprobs: list[list[_MsNumber]] | None | _Unset = msgspec.UNSET
    overrides: list[dict[str, Any]] | None | _Unset = msgspec.UNSET
    group_overrides: dict[str, Any] | None | _Unset = msgspec.UNSET
    images: Any = msgspec.UNSET
    env_id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None | _Unset = msgspec.UNSET
    distill_token_ids: list[list[list[_MsTokenId]]] | None | _Unset = msgspec.UNSET
    distill_logprobs: list[list[list[_MsNumber]]] | None | _Unset = msgspec.UNSET


class FastKnownGroup(FastScoredGroup, frozen=True, forbid_unknown_fields=True):
    """A group as atroposlib and this project's clients send it, read in a single pass.

    Only Atropos' fields and our per-episode `episodes` metadata, so that no field goes
    unseen: a group with any other field is read by `FastScoredGroup` plus a pass over its
    fields, which checks what this one checks here.

    `inference_logprobs`, the largest field, is kept as its JSON text: the usual one (rows
    of decimal floats) is checked on the text (ingest.float_rows_checked), faster than
    making a Python float of each value; any other is then read as `FastScoredGroup` reads it.
    """

    episodes: Any = msgspec.UNSET
    inference_logprobs: msgspec.Raw | _Unset = msgspec.UNSET


#: Bounds on every number a client chooses, so no request can make the server do work (or
#: hold memory) proportional to a number it made up. A batch of 65,536 sequences is far
#: beyond any trainer's; int32 covers token lengths, steps and intervals.
MAX_BATCH_SIZE = 65_536
INT32 = 2**31
MAX_NAME = 256
MAX_PATH = 4096
#: env_id and batch ids are SQLite integers.
Int63 = Annotated[int, Field(ge=0, lt=2**63)]
Count = Annotated[int, Field(ge=-1, lt=INT32)]  # Atropos uses -1 for "no limit" / "never"


class Registration(BaseModel):
    """POST /register: a trainer announces itself and its batch geometry.

    Missing fields take defaults (Atropos requires them all); `null` is refused, as Atropos does.
    """

    wandb_group: str = Field("", max_length=MAX_NAME)
    wandb_project: str = Field("", max_length=MAX_NAME)
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, description="Sequences per batch (not groups).")
    max_token_len: Count
    checkpoint_dir: str = Field("", max_length=MAX_PATH)
    save_checkpoint_interval: Count = -1
    starting_step: int = Field(0, ge=0, lt=INT32)
    num_steps: Count = -1


class RegisterEnv(BaseModel):
    """POST /register-env: an environment worker asks for an env_id."""

    max_token_length: Count
    desired_name: str = Field(max_length=MAX_NAME)
    # Atropos documents -1 as "ignore my weight"; negative weights count as 0 in the shares.
    weight: float = Field(1.0, ge=-1e6, le=1e6, allow_inf_nan=False)
    group_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    min_batch_allocation: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    # (ours) A worker that registers again under the same id (after a restart) gets its old
    # env_id back instead of leaving a dead registration that is owed a share of every batch.
    worker_id: str | None = Field(None, min_length=1, max_length=MAX_NAME)


class EnvIdentifier(BaseModel):
    env_id: Int63


class RegisterResponse(BaseModel):
    # Atropos answers uuid4().int: a 128-bit JSON integer.
    uuid: int


class RegisterEnvResponse(BaseModel):
    status: str
    env_id: int | None = None
    wandb_name: str | None = None
    checkpoint_dir: str | None = None
    starting_step: int | None = None
    checkpoint_interval: int | None = None
    num_steps: int | None = None


class StatusResponse(BaseModel):
    current_step: int
    queue_size: int


class StatusEnvResponse(BaseModel):
    current_step: int
    queue_size: int
    unallocated_fraction: float
    self_queue_size: int
    max_group_size: int
    env_weight: float


class InfoResponse(BaseModel):
    batch_size: int
    max_token_len: int


class WandbInfoResponse(BaseModel):
    group: str | None
    project: str | None
