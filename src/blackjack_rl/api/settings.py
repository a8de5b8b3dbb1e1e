"""Settings of the trajectory API.

One pydantic model holds every knob, so the same values come from the command line,
from environment variables (`BLACKJACK_RL_API_<FIELD>`, e.g. `BLACKJACK_RL_API_TOKEN`) or
from the project's YAML config, and are checked once, before the server starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 1024 * 1024


class ApiConfig(BaseSettings):
    """How the trajectory API listens, where it keeps its data, and what it accepts."""

    model_config = SettingsConfigDict(env_prefix="BLACKJACK_RL_API_", extra="forbid")

    host: str = Field(
        "127.0.0.1",
        description="Interface to bind. The default keeps the API off the network; "
        "use 0.0.0.0 only together with a token.",
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port (8000 is what Atropos trainers expect).")
    db_path: Path = Field(
        Path("blackjack_rl_api.sqlite"),
        description="SQLite file holding registrations, the step counter and the queue. "
        "Use one file per training run.",
        json_schema_extra={"flag": "--db", "metavar": "PATH"},
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token required on every endpoint when set. Destructive endpoints "
        "(/reset_data) are refused unless a token is configured. Prefer BLACKJACK_RL_API_TOKEN: "
        "flags show up in `ps`.",
    )
    max_queued_sequences: int = Field(
        100_000,
        ge=1,
        description="Backpressure: posts that would push the queue past this many sequences get "
        "503 with Retry-After.",
        json_schema_extra={"metavar": "N"},
    )
    max_body_bytes: int = Field(
        16 * MIB,
        ge=1024,
        description="Largest request body accepted, both as sent and after gzip decompression "
        "(bytes; the flag takes MB).",
        json_schema_extra={"flag": "--max-body-mb", "metavar": "MB", "scale": MIB},
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API (CORS); repeat the flag for more. Empty: CORS off.",
        json_schema_extra={"flag": "--cors-origin", "metavar": "ORIGIN"},
    )
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "FULL",
        description="SQLite durability. Both survive a killed process; FULL also survives power loss "
        "(commits are grouped, so it costs little throughput).",
        json_schema_extra={"flag": "--sync"},
    )
    retry_after_s: int = Field(2, ge=1, description="Retry-After (seconds) sent with 503 responses.",
                               json_schema_extra={"flag": "--retry-after", "metavar": "SECONDS"})
    idempotency_ttl_s: float = Field(
        24 * 3600.0,
        gt=0,
        description="How long an Idempotency-Key is remembered, so a retried post is not queued twice.",
        json_schema_extra={"flag": "--idempotency-ttl", "metavar": "SECONDS"},
    )
    env_lease_s: float = Field(
        3.0,
        ge=0.5,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
        description="An environment silent this long (no request naming its env_id: status-env, posts, "
        "registration, disconnect-env) no longer holds its min_batch_allocation share of batches, so a "
        "worker killed without disconnecting stalls training for at most this long; its queued groups "
        "are still delivered, and it is owed its share again when it is heard from. Keep it at about "
        "three of your workers' /status-env polls (`blackjack-rl serve` polls every second, atroposlib's "
        "workers several times a second).",
        json_schema_extra={"flag": "--env-lease", "metavar": "SECONDS"},
    )
    ingest_workers: int | None = Field(
        None,
        ge=0,
        le=256,
        description="Processes that parse and check posted groups (default: 1 when the server may use "
        "2 or more cores, else 0, which checks them in the server process). One worker takes ~40% "
        "of the CPU off the server process; more help only when it has cores to spare.",
        json_schema_extra={"metavar": "N"},
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="uvicorn's log level.")
    access_log: bool = Field(False, description="Log every request (noisy at thousands of posts a second).")

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        """An empty `BLACKJACK_RL_API_TOKEN=` means no token, not a token that is the empty string."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return value

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None
