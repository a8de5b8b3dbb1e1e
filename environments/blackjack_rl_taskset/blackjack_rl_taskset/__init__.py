"""blackjack-rl as a verifiers 0.4 taskset: `vf-eval blackjack-rl-taskset -m MODEL --client.base-url URL`.

verifiers resolves the id to this package and takes the one `Taskset` and the one `Env`
that `__all__` exports: the taskset yields one task per deal seed, the env plays the hand.
"""

from blackjack_rl_taskset.taskset import (
    BlackjackData,
    BlackjackTableEnv,
    BlackjackTableEnvConfig,
    BlackjackTask,
    BlackjackTaskset,
    BlackjackTasksetConfig,
)

__all__ = [
    "BlackjackData",
    "BlackjackTableEnv",
    "BlackjackTableEnvConfig",
    "BlackjackTask",
    "BlackjackTaskset",
    "BlackjackTasksetConfig",
]
