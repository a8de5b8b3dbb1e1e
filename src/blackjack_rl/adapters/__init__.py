"""`BlackjackEnv` as the environments that trainers know: Gymnasium, TRL, verifiers, OpenEnv, SkyRL-gym.

Each adapter is a thin translation of `blackjack_rl.env.BlackjackEnv` (the one game loop)
into a library's own interface, and lives behind that library's optional extra; only the
Gymnasium one needs nothing beyond the core install. Importing this package registers
``blackjack_rl/BlackjackText-v0`` with Gymnasium.
"""

from blackjack_rl.adapters.gym_env import ENV_ID, register_gymnasium

register_gymnasium()

__all__ = ["ENV_ID", "register_gymnasium"]
