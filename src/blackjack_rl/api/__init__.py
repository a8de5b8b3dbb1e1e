"""Trajectory API: an Atropos-compatible, durable queue between environment workers and trainers.

`create_app(ApiConfig(...))` builds the server; `EnvClient` feeds it from environment workers
(with retries and an on-disk outbox); `TrainerClient` pulls batches.
"""

from blackjack_rl.api.client import ApiRejected, ApiUnavailable, Batch, EnvClient, TrainerClient
from blackjack_rl.api.server import create_app
from blackjack_rl.api.settings import ApiConfig

__all__ = ["ApiConfig", "ApiRejected", "ApiUnavailable", "Batch", "EnvClient", "TrainerClient", "create_app"]
