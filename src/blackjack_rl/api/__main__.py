"""`python -m blackjack_rl.api --help`"""

from blackjack_rl.api.cli import main

if __name__ == "__main__":  # guarded: ingest worker processes import this module too
    raise SystemExit(main())
