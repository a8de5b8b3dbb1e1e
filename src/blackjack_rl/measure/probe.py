"""Read a policy's first-decision strategy off its probabilities, without sampling.

For every chart state the opening prompt is built exactly as an episode builds it, and the
policy scores the two valid calls (`answer_logprobs_many`). Bots give their exact hit
probability. The result feeds grid.py, which turns it into exact values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from blackjack_rl.rollout.episodes import opening_messages
from blackjack_rl.game.table import Observation
from blackjack_rl.game.solver import GRID_STATES, GridKey
from blackjack_rl.rollout.credit import hit_share
from blackjack_rl.rollout.players import Player
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.policies.base import KnowsItsPolicy, ScoresAnswers


@dataclass(frozen=True)
class Probe:
    p_hit: dict[GridKey, float]  # P(hit | one of the two valid calls)
    p_calls: dict[GridKey, float] | None  # P(the answer is exactly one of the two canonical calls)
    temperature: float | None  # the distribution the probabilities are of (None: a bot's exact policy)


def can_probe(policy: Any) -> bool:
    return isinstance(policy, (KnowsItsPolicy, ScoresAnswers))


async def probe_policy(player: Player, temperature: float | None = None, calls_probability: bool = True) -> Probe:
    """`temperature` None: the policy's sampling temperature (a model), or its exact policy (a bot).
    `calls_probability` False skips P(a canonical call), which costs a third of the work."""
    policy = player.policy
    if isinstance(policy, KnowsItsPolicy):
        return Probe({k: float(policy.hit_probability(Observation(*k), False)) for k in GRID_STATES}, None, None)
    if not isinstance(policy, ScoresAnswers):
        raise ValueError(
            f"{policy.name} cannot score given answers, so its strategy cannot be read without sampling "
            "(the grid needs the embedded, hf or a scripted policy)"
        )
    t = temperature if temperature is not None else float(policy.temperature or 1.0)
    chat = player.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(STICK))]
    # The calls' shared beginning is the same factor in both probabilities: it cancels in
    # P(hit | valid) and is scored once (as context) for P(a canonical call).
    shared = common_prefix_length(calls)
    items = []
    for k in GRID_STATES:
        prompt = chat.prompt_ids(opening_messages(Observation(*k), player.settings.thinking))
        if calls_probability:
            items.append((prompt, [calls[0][:shared]]))
        items.append(([*prompt, *calls[0][:shared]], [c[shared:] for c in calls]))
    # a chart read at the 1e-2 level may use llama.cpp's faster batched kernels
    scored = await policy.answer_logprobs_many(items, t, same_kernels=False)
    p_hit, p_calls = {}, {}
    step = 2 if calls_probability else 1
    for i, k in enumerate(GRID_STATES):
        lp_hit, lp_stick = scored[step * i + step - 1]
        p_hit[k] = hit_share(sum(lp_hit), sum(lp_stick))
        if calls_probability:
            (lp_shared,) = scored[step * i]
            p_calls[k] = math.exp(sum(lp_shared)) * (math.exp(sum(lp_hit)) + math.exp(sum(lp_stick)))
    return Probe(p_hit, p_calls or None, t)


async def exact_grid(player: Player) -> dict[str, Any]:
    """The exact chart numbers of a policy, as recorded in metrics.json (`evaluate --grid`)."""
    import time

    from blackjack_rl.measure.grid import evaluate_grid

    t0 = time.perf_counter()
    probe = await probe_policy(player)
    g = evaluate_grid(player.solution, probe.p_hit)
    return {
        **g.to_dict(),
        "temperature": probe.temperature,
        "p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None,
        "seconds": time.perf_counter() - t0,
    }
