"""Trajectory API: an Atropos-compatible, durable queue between environment workers and trainers.

`create_app(ApiConfig(...))` builds the server; `EnvClient` feeds it from environment workers
(with retries and an on-disk outbox); `TrainerClient` pulls batches.

The names load on first use (PEP 562): a trainer or worker that imports the client alone never
imports FastAPI and the server, a third of a second of start-up for every `train` command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blackjack_rl.api.client import ApiRejected, ApiUnavailable, Batch, EnvClient, TrainerClient
    from blackjack_rl.api.server import create_app
    from blackjack_rl.api.settings import ApiConfig

_WHERE = {"ApiRejected": "client", "ApiUnavailable": "client", "Batch": "client", "EnvClient": "client",
          "TrainerClient": "client", "create_app": "server", "ApiConfig": "settings"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
