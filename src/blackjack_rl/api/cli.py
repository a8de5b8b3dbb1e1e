"""`blackjack-rl api` / `python -m blackjack_rl.api`: run the trajectory API with uvicorn."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from typing import Any

from pydantic import ValidationError

from .settings import MIB, ApiConfig

_EPILOG = """\
environment variables (flags win over them):
  BLACKJACK_RL_API_TOKEN     bearer token (prefer this to --token: flags show up in `ps`)
  BLACKJACK_RL_API_HOST, BLACKJACK_RL_API_PORT, BLACKJACK_RL_API_DB_PATH,
  BLACKJACK_RL_API_MAX_QUEUED_SEQUENCES, BLACKJACK_RL_API_MAX_BODY_BYTES,
  BLACKJACK_RL_API_CORS_ORIGINS (a JSON list), BLACKJACK_RL_API_SYNCHRONOUS,
  BLACKJACK_RL_API_INGEST_WORKERS, BLACKJACK_RL_API_ENV_LEASE_S

Atropos trainers and environments connect unchanged (default port 8000). The queue
survives restarts: one --db file per training run (or reset it with GET /reset_data,
which needs a token). Docs: docs/api.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blackjack-rl api",
        description="Serve the trajectory API: a durable, bounded, Atropos-compatible queue between "
        "environment workers (POST /scored_data_list) and a trainer (GET /batch).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1: this machine only; "
                        "use 0.0.0.0 to serve other machines, with a token)")
    parser.add_argument("--port", type=int, help="TCP port (default 8000, where Atropos trainers look)")
    parser.add_argument("--db", metavar="PATH", help="SQLite file for registrations and the queue "
                        "(default ./blackjack_rl_api.sqlite)")
    parser.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on every request and enable "
                        "/reset_data (default: $BLACKJACK_RL_API_TOKEN, else no auth)")
    parser.add_argument("--max-queued-sequences", type=int, metavar="N",
                        help="backpressure: beyond N queued sequences posts get 503 + Retry-After (default 100000)")
    parser.add_argument("--max-body-mb", type=float, metavar="MB",
                        help="largest request body, compressed or not (default 16)")
    parser.add_argument("--cors-origin", action="append", metavar="ORIGIN", dest="cors_origins",
                        help="allow browser requests from ORIGIN (repeatable; default: CORS off)")
    parser.add_argument("--sync", choices=["NORMAL", "FULL"], dest="synchronous",
                        help="SQLite durability: both survive a crashed process, FULL also a power cut (default FULL)")
    parser.add_argument("--ingest-workers", type=int, metavar="N",
                        help="processes that parse and check posts (default 0: the server process; "
                        "a few help on machines with many cores)")
    parser.add_argument("--env-lease", type=float, metavar="SECONDS", dest="env_lease_s",
                        help="an environment silent this long stops holding its min_batch_allocation share "
                        "(default 120)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--access-log", action="store_true", default=None, help="log every request")
    return parser


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    """Flags that were given override environment variables and defaults."""
    given: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "db_path": args.db,
        "token": args.token,
        "max_queued_sequences": args.max_queued_sequences,
        "max_body_bytes": int(args.max_body_mb * MIB) if args.max_body_mb is not None else None,
        "cors_origins": args.cors_origins,
        "synchronous": args.synchronous,
        "ingest_workers": args.ingest_workers,
        "env_lease_s": args.env_lease_s,
        "log_level": args.log_level,
        "access_log": args.access_log,
    }
    return ApiConfig(**{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            print(f"error: {'.'.join(map(str, error['loc']))}: {error['msg']}", file=sys.stderr)
        return 2
    return serve(config)


def serve(config: ApiConfig) -> int:
    import uvicorn

    from .server import create_app
    from .store import Store

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
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
    )
    return 0
