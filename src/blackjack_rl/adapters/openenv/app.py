"""The module-level app the manifest names (`uvicorn blackjack_rl.adapters.openenv.app:app`): default rules and settings."""

from blackjack_rl.adapters.openenv.server import create_openenv_app

app = create_openenv_app()
