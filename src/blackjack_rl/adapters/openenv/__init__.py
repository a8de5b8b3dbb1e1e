"""OpenEnv: an HTTP/WebSocket environment server (the `openenv` package), its models and its client.

Start it with ``python -m blackjack_rl.adapters.openenv`` (binds 127.0.0.1 unless told
otherwise); the manifest is ``openenv.yaml`` beside this file. The names below load
OpenEnv on first use, so the command can say in one line when the extra is missing.
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "BlackjackAction": "models",
    "BlackjackObservation": "models",
    "BlackjackState": "models",
    "BlackjackEnvironment": "server",
    "create_openenv_app": "server",
    "BlackjackOpenEnvClient": "client",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
