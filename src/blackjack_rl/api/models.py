"""Wire models: the request and response bodies of the Atropos trajectory API (atroposlib 0.4.0).

Field names are Atropos' own, so its trainers and environments work unchanged. Where Atropos
is lax we are strict about what would corrupt training (types, shapes, finiteness), and lax
about what it tolerates in practice (`wandb_group: null` from its example trainer, optional
fields sent as empty lists by its environments).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    overrides: list[dict[str, Any] | None] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: StrictInt | None = None
    distill_token_ids: list[list[list[StrictInt]]] | None = None
    distill_logprobs: list[list[list[StrictFloat]]] | None = None

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


class Registration(BaseModel):
    """POST /register: a trainer announces itself and its batch geometry."""

    wandb_group: str | None = None
    wandb_project: str | None = None
    batch_size: int = Field(ge=1, description="Sequences per batch (not groups).")
    max_token_len: int
    checkpoint_dir: str = ""
    save_checkpoint_interval: int = -1
    starting_step: int = Field(0, ge=0)
    num_steps: int = -1


class RegisterEnv(BaseModel):
    """POST /register-env: an environment worker asks for an env_id."""

    max_token_length: int
    desired_name: str
    # Atropos documents -1 as "ignore my weight"; negative weights count as 0 in the shares.
    weight: float | None = Field(1.0, allow_inf_nan=False)
    group_size: int = Field(ge=1)
    min_batch_allocation: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)


class EnvIdentifier(BaseModel):
    env_id: int


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
