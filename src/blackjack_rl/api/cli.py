"""`blackjack-rl api` / `python -m blackjack_rl.api`: run the trajectory API with uvicorn."""

from __future__ import annotations

import argparse
import sqlite3
import sys
import textwrap

from pydantic import ValidationError

from blackjack_rl.cli_options import Parser, add_options, given, options_of, select, validation_error
from blackjack_rl.api.settings import ApiConfig

def _epilog() -> str:
    prefix = ApiConfig.model_config.get("env_prefix", "")
    names = [prefix + name.upper() for name in ApiConfig.model_fields]
    return (
        "environment variables (flags win over them):\n  "
        + textwrap.fill(", ".join(names), width=78, subsequent_indent="  ")
        + "\n  (a list, like BLACKJACK_RL_API_CORS_ORIGINS, as JSON; prefer BLACKJACK_RL_API_TOKEN to --token)\n\n"
        "Atropos trainers and environments connect unchanged (default port 8000). The queue\n"
        "survives restarts: one --db file per training run (or reset it with GET /reset_data,\n"
        "which needs a token). Docs: docs/api.md.\n"
    )


def build_parser() -> argparse.ArgumentParser:
    """Every ApiConfig field is a flag (cli_options derives them from the model)."""
    parser = Parser(
        prog="blackjack-rl api",
        description="Serve the trajectory API: a durable, bounded, Atropos-compatible queue between "
        "environment workers (POST /scored_data_list) and a trainer (GET /batch).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, select(ApiConfig, ApiConfig.model_fields))
    return parser


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    """Flags that were given override environment variables and defaults."""
    return ApiConfig(**given(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        print(f"error: {validation_error(exc, options_of(args))}", file=sys.stderr)
        return 2
    return serve(config)


def serve(config: ApiConfig) -> int:
    import uvicorn

    from blackjack_rl.api.malloc import keep_freed_memory
    from blackjack_rl.api.server import create_app
    from blackjack_rl.api.store import Store

    if config.host not in ("127.0.0.1", "localhost", "::1") and config.token is None:
        print(
            f"warning: serving on {config.host} without a token: anyone who can reach this port can "
            "read and inject training data (set BLACKJACK_RL_API_TOKEN)",
            file=sys.stderr,
        )
    try:  # open the store once first: a bad --db fails with one clear line, not a startup traceback
        Store(config.db_path).close()
    except (OSError, RuntimeError, sqlite3.Error) as exc:  # in use, a directory, another schema, damaged
        detail = f"{exc} (is it a trajectory API database, and not damaged?)" if isinstance(exc, sqlite3.Error) else exc
        print(f"error: {detail}", file=sys.stderr)
        return 1
    keep_freed_memory()  # this process is the server's: page faults cost it more than memory kept
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
    )
    return 0
