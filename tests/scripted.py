"""A scripted player for tests: answers chosen by a function of the turn (valid or not)."""

from __future__ import annotations

from blackjack_rl.policies.base import Reply


class Scripted:
    name = "scripted"

    def __init__(self, fn):
        self.fn = fn

    def generation_params(self):
        return {"policy": "scripted"}

    async def respond(self, turn):
        return Reply(text=self.fn(turn))

    async def aclose(self):
        pass
