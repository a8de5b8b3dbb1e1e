"""OpenEnv: an HTTP/WebSocket environment server (openenv-core), its models and its client.

Start it with ``python -m blackjack_rl.adapters.openenv`` (binds 127.0.0.1 unless told
otherwise); the manifest is ``openenv.yaml`` beside this file.
"""

from .client import BlackjackOpenEnvClient
from .models import BlackjackAction, BlackjackObservation, BlackjackState
from .server import BlackjackEnvironment, create_openenv_app

__all__ = [
    "BlackjackAction",
    "BlackjackEnvironment",
    "BlackjackObservation",
    "BlackjackOpenEnvClient",
    "BlackjackState",
    "create_openenv_app",
]
