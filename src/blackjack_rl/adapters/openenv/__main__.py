"""`python -m blackjack_rl.adapters.openenv`: serve the environment to OpenEnv clients."""

from __future__ import annotations

import argparse
import sys

from blackjack_rl.env import EnvSettings
from blackjack_rl.game.table import Rules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blackjack_rl.adapters.openenv", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--natural", action="store_true", help="a natural pays 1.5")
    parser.add_argument("--sab", action="store_true", help="Sutton & Barto rules")
    parser.add_argument("--scoring", choices=["outcome", "expected"], default="outcome")
    parser.add_argument("--format-bonus", type=float, default=0.0)
    parser.add_argument("--invalid-score", type=float, default=-1.0)
    parser.add_argument("--invalid-retries", type=int, default=0)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--max-concurrent-envs", type=int, default=64, help="WebSocket sessions at once")
    args = parser.parse_args(argv)
    try:
        settings = EnvSettings(invalid_score=args.invalid_score, max_turns=args.max_turns, scoring=args.scoring,
                               format_bonus=args.format_bonus, invalid_retries=args.invalid_retries)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    if not 1 <= args.max_concurrent_envs <= 4096:
        parser.exit(2, "error: --max-concurrent-envs must be between 1 and 4096\n")

    try:
        import uvicorn

        from blackjack_rl.adapters.openenv.server import create_openenv_app
    except ImportError as exc:
        parser.exit(2, f"error: {exc.name} is not installed: pip install 'blackjack-rl[openenv]'\n")

    app = create_openenv_app(Rules(natural=args.natural, sab=args.sab), settings, args.max_concurrent_envs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
