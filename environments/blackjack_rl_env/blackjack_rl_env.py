"""blackjack-rl as a verifiers environment: `vf-eval blackjack-rl-env -m MODEL -b URL`.

Keyword arguments (`-a '{"scoring": "expected", "invalid_retries": 1}'`) are the rules
(`natural`, `sab`), the deal counts and blackjack-rl's `EnvSettings` fields.
"""

from blackjack_rl.adapters.verifiers_env import load_environment

__all__ = ["load_environment"]
