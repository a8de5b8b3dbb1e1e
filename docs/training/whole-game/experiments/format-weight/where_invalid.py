"""Where a trained adapter's invalid-answer mass lies: 1 - p of each token of the canonical calls.

Run from the repository root: python docs/training/whole-game/experiments/format-weight/where_invalid.py whole-game

The embedded model (llama.cpp) with the adapter (a shipped name, a .gguf or a peft folder) scores
the two valid calls at the 280 opening prompts of the chart, at temperature 1. Printed: the mean
P(one of the two calls), and the mean 1 - p(token) at each position of the calls' shared
beginning and of the optimal call's end. A token the trainer leaves out with --skip-certain E
sits at 1 - p < E.
"""

from __future__ import annotations

import asyncio
import math
import sys

from blackjack_rl.config import load_settings
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.game.solver import GRID_STATES
from blackjack_rl.game.table import Observation
from blackjack_rl.rollout.episodes import opening_messages
from blackjack_rl.rollout.players import build_player


async def scores(player, calls):
    prompts = [player.chat.prompt_ids(opening_messages(Observation(*k), False)) for k in GRID_STATES]
    try:
        return await player.policy.answer_logprobs_many([(p, calls) for p in prompts], 1.0, same_kernels=False)
    finally:
        await player.policy.aclose()


def main(lora: str) -> None:
    player = build_player(load_settings(overrides={"policy": {"kind": "embedded", "lora": lora}}))
    calls = [player.chat.answer_ids(tool_call_text(HIT)), player.chat.answer_ids(tool_call_text(STICK))]
    shared = common_prefix_length(calls)
    scored = asyncio.run(scores(player, calls))
    n = len(GRID_STATES)
    miss = [0.0] * len(calls[0])
    p_calls = 0.0
    for key, (hit, stick) in zip(GRID_STATES, scored):
        best = hit if player.solution.best_action(key) == HIT else stick
        for i, lp in enumerate(best):
            if i != shared:  # the action word: which call, not whether it is one
                miss[i] += (1 - math.exp(lp)) / n
        p_calls += math.exp(sum(hit[:shared])) * (math.exp(sum(hit[shared:])) + math.exp(sum(stick[shared:]))) / n
    print(f"{len(calls[0])} tokens a call, {shared} shared; mean P(one of the two calls) {p_calls:.5f}")
    print("mean 1 - p, shared beginning:", " ".join(f"{m:.5f}" for m in miss[:shared]), f"(sum {sum(miss[:shared]):.5f})")
    print("mean 1 - p, the optimal call's end:", " ".join(f"{m:.5f}" for m in miss[shared + 1:]),
          f"(sum {sum(miss[shared + 1:]):.5f})")
    certain = [m for i, m in enumerate(miss) if i != shared and m < 1e-3]
    print(f"tokens at 1 - p below 1e-3 (left out by --skip-certain 1e-3): {len(certain)} of {len(miss) - 1}, "
          f"holding {sum(certain):.5f} of the {1 - p_calls:.5f} missing")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "whole-game")
