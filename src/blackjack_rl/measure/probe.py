"""Read a policy's strategy off its probabilities, without sampling.

For every chart state the opening prompt is built exactly as an episode builds it, and the
policy scores the two valid calls (`answer_logprobs_many`). Bots give their exact hit
probability. The result feeds grid.py, which turns it into exact values.

The same reading at every history a game can reach (the prompt after one or more hits)
feeds tree.py, which gives the exact value of the whole-game policy (`exact_game`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from blackjack_rl.rollout.episodes import opening_messages
from blackjack_rl.game.table import Observation
from blackjack_rl.game.solver import GRID_STATES, GridKey
from blackjack_rl.measure.tree import History, NodePolicy, Progress, deals, evaluate_game, is_natural
from blackjack_rl.rollout.credit import hit_share
from blackjack_rl.rollout.players import Player
from blackjack_rl.contract.protocol import HIT, STICK, observation_text, tool_call_text
from blackjack_rl.contract.tokens import ChatFormat, common_prefix_length
from blackjack_rl.policies.base import KnowsItsPolicy, ScoresAnswers

# Histories scored by `exact_game` unless told otherwise. A model's reading costs about as much
# as a chart cell (the prompt's new turn and the two calls); a bot's costs microseconds, and
# this many cover the trees of the optimal and threshold bots (~170,000 histories). Measured
# (docs/report.md): 1,000 for the three-phase adapter took 16 min on 2 shared cores, width 0.088.
GAME_BUDGET = 1_000
BOT_GAME_BUDGET = 200_000
# A model's tree stops early once the certified interval is this narrow (bots: covered), but
# not before its first decisions and this many more are scored: the after-hit accuracy's reading.
GAME_TARGET_WIDTH = 0.004
GAME_AFTER_HIT_NODES = 128


@dataclass(frozen=True)
class Probe:
    p_hit: dict[GridKey, float]  # P(hit | one of the two valid calls)
    p_calls: dict[GridKey, float] | None  # P(the answer is exactly one of the two canonical calls)
    temperature: float | None  # the distribution the probabilities are of (None: a bot's exact policy)


def can_probe(policy: Any) -> bool:
    return isinstance(policy, (KnowsItsPolicy, ScoresAnswers))


async def probe_policy(player: Player, temperature: float | None = None, calls_probability: bool = True,
                       states: Sequence[GridKey] = GRID_STATES) -> Probe:
    """`temperature` None: the policy's sampling temperature (a model), or its exact policy (a bot).
    `calls_probability` False skips P(a canonical call), which saves a trainer's torch model the
    vocabulary head over the calls' shared beginning (llama.cpp decodes the same tokens either way).
    `states`: the chart cells read (all of them unless told: grid.py needs every one); a cell's
    numbers do not depend on which others are read with it."""
    policy = player.policy
    if isinstance(policy, KnowsItsPolicy):
        return Probe({k: float(policy.hit_probability(Observation(*k), False)) for k in states}, None, None)
    _check_scores(policy)
    t = temperature if temperature is not None else float(policy.temperature or 1.0)
    prompts = [player.chat.prompt_ids(opening_messages(Observation(*k), player.settings.thinking)) for k in states]
    scored = await _score_calls(player, prompts, t, calls_probability)
    p_hit = {k: hit_share(hit, stick) for k, (_, hit, stick) in zip(states, scored)}
    p_calls = {k: math.exp(shared) * (math.exp(hit) + math.exp(stick))
               for k, (shared, hit, stick) in zip(states, scored)} if calls_probability else None
    return Probe(p_hit, p_calls, t)


async def _score_calls(player: Player, prompts: Sequence[list[int]], temperature: float,
                       whole: bool = True) -> list[tuple[float, float, float]]:
    """Per prompt, the logprobs of the two calls' shared beginning and of each call's end after it.

    The shared beginning is the same factor in both calls: it cancels in P(hit | valid) and is
    decoded once. `whole` scores the two whole calls in one item (the beginning's logprob is
    then known); otherwise the beginning is context only (0.0 in its place), which saves a
    trainer the vocabulary head over it. A chart read at the 1e-2 level may use llama.cpp's
    faster batched kernels (`same_kernels=False`)."""
    chat = player.chat
    calls = [chat.answer_ids(tool_call_text(HIT)), chat.answer_ids(tool_call_text(STICK))]
    shared = common_prefix_length(calls)
    if whole:
        items = [(prompt, calls) for prompt in prompts]
    else:
        items = [([*prompt, *calls[0][:shared]], [c[shared:] for c in calls]) for prompt in prompts]
    scored = await player.policy.answer_logprobs_many(items, temperature, same_kernels=False) if items else []
    at = shared if whole else 0
    return [(sum(hit[:at]), sum(hit[at:]), sum(stick[at:])) for hit, stick in scored]


def _check_scores(policy: Any) -> None:
    if not isinstance(policy, ScoresAnswers):
        raise ValueError(
            f"{policy.name} cannot score given answers, so its strategy cannot be read without sampling "
            "(the grid needs the embedded, hf or a scripted policy)"
        )


async def exact_grid(player: Player, game_budget: int | None = None) -> dict[str, Any]:
    """The exact chart numbers of a policy, as recorded in metrics.json (`evaluate --grid`), with
    the whole-game numbers under "whole_game" (`exact_game`; its first decisions are this chart's),
    None for a `game_budget` of 0."""
    from blackjack_rl.measure.grid import evaluate_grid

    t0 = time.perf_counter()
    probe = await probe_policy(player)
    g = evaluate_grid(player.solution, probe.p_hit)
    return {
        **g.to_dict(),
        "temperature": probe.temperature,
        "p_calls": sum(probe.p_calls.values()) / len(probe.p_calls) if probe.p_calls else None,
        "whole_game": await exact_game(player, game_budget, probe=probe),
        "seconds": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------- the whole game


def history_ids(chat: ChatFormat, history: History, thinking: bool = False) -> list[int]:
    """The prompt of the decision at `history`, token for token as an episode builds it: the
    opening, then per hit the answer the model gave (the canonical hit call, as `answer_ids`
    tokenizes it: what the probe scores) and the next user turn."""
    ids = chat.prompt_ids(opening_messages(history[0], thinking))
    if len(history) > 1:
        hit = chat.answer_ids(tool_call_text(HIT))
        for obs in history[1:]:
            ids += hit + chat.next_turn_ids(observation_text(*obs))
    return ids


def node_policy(player: Player, temperature: float | None = None, probe: Probe | None = None) -> NodePolicy:
    """The policy at histories, for tree.py: (P(hit), P(stick)) of each. A bot's are exact (no
    invalid mass); a model's are the probabilities of the two canonical calls, whole. `probe`,
    a `probe_policy` reading with `p_calls` at the same temperature, gives the first decisions."""
    policy = player.policy
    if isinstance(policy, KnowsItsPolicy):
        async def bot(histories: Sequence[History]) -> list[tuple[float, float]]:
            hits = [float(policy.hit_probability(h[-1], is_natural(h))) for h in histories]
            return [(h, 1.0 - h) for h in hits]

        return bot
    _check_scores(policy)
    t = temperature if temperature is not None else float(policy.temperature or 1.0)
    known: dict[Observation, tuple[float, float]] = {}
    if probe is not None and probe.p_calls and probe.temperature == t:
        known = {k: (probe.p_calls[k] * h, probe.p_calls[k] * (1.0 - h)) for k, h in probe.p_hit.items()}

    async def model(histories: Sequence[History]) -> list[tuple[float, float]]:
        return await _score_histories(player, t, histories, known)

    return model


async def _score_histories(player: Player, temperature: float, histories: Sequence[History],
                           known: dict[Observation, tuple[float, float]]) -> list[tuple[float, float]]:
    """Score the two calls at each history as the probe scores them (so a first decision reads
    the same numbers), neighbours in prompt order so llama.cpp reuses its cache between them."""
    chat, settings = player.chat, player.settings
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(histories)
    todo = []
    for i, h in enumerate(histories):
        if len(h) == 1 and h[0] in known:
            out[i] = known[h[0]]
            continue
        prompt = history_ids(chat, h, settings.thinking)
        # an episode whose next answer would not fit its token budget ends truncated, scored
        # like invalid: P(hit) = P(stick) = 0, as here
        if len(prompt) + settings.max_new_tokens <= settings.max_token_length:
            todo.append((prompt, i))
    todo.sort()
    scored = await _score_calls(player, [prompt for prompt, _ in todo], temperature)
    for (_, i), (lp_shared, lp_hit, lp_stick) in zip(todo, scored):
        out[i] = (math.exp(lp_shared + lp_hit), math.exp(lp_shared + lp_stick))
    return out


async def exact_game(player: Player, budget: int | None = None, target_width: float | None = None,
                     temperature: float | None = None, probe: Probe | None = None,
                     progress: Progress | None = None) -> dict[str, Any] | None:
    """The exact value of the policy over whole games (tree.py), as a JSON-ready dict; None for a
    `budget` of 0 (the chart alone), where None is the default budget.

    For a model, P(hit) and P(stick) at a history are the probabilities of the two canonical
    calls exactly (their shared beginning included), and P(invalid) is everything else: also
    a valid call written any other way, and the histories that would follow it. With an invalid
    score of -1 or lower no game scores less than a forfeit, so `value_low` is a certified
    lower bound of the policy's true expected reward (invalid = invalid score, no format bonus),
    exact for a policy that writes only the canonical calls; `value_high` bounds the game of
    canonical calls only. A bot's numbers are exact. Temperature as in `probe_policy`; top-p,
    top-k and min-p truncation are not modelled. An invalid answer forfeits, as with the
    default `invalid_retries` 0 (a re-prompt could only score more than a forfeit of -1).
    """
    if budget == 0:
        return None
    t0 = time.perf_counter()
    bot = isinstance(player.policy, KnowsItsPolicy)
    budget = budget or (BOT_GAME_BUDGET if bot else GAME_BUDGET)
    target = target_width if target_width is not None else (0.0 if bot else GAME_TARGET_WIDTH)
    policy = node_policy(player, temperature, probe)
    tree = await evaluate_game(player.solution, policy, invalid_score=player.settings.invalid_score,
                               max_turns=player.settings.max_turns, budget=budget, target_width=target,
                               min_nodes=len(deals()) + GAME_AFTER_HIT_NODES, batch=max(256, len(deals())),
                               progress=progress)
    t = None if bot else (temperature if temperature is not None else float(player.policy.temperature or 1.0))
    return {**tree.to_dict(), "budget": budget, "target_width": target, "temperature": t,
            "invalid_score": player.settings.invalid_score, "seconds": time.perf_counter() - t0}
