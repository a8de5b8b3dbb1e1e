"""`python -m blackjack_rl.api --help`"""

from .cli import main

raise SystemExit(main())
