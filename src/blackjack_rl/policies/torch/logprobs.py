"""The model's logprob of given tokens: what the torch policy scores answers with, and what the
trainer's loss differentiates, so that sampled, scored and trained logprobs are one computation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ...tokens import common_prefix_length
from .forward import causal_lm, forward_rows, run_prefix


@dataclass
class Targets:
    """Trained positions of a group, flattened: row, position, token, logprob when sampled."""

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    old_logprobs: torch.Tensor | None  # None when the group carries none usable


def token_logprobs(
    model: Any,
    tokens: Sequence[Sequence[int]],
    targets: Targets,
    temperature: float,
    *,
    first_layer: int = 0,
    states: Mapping[tuple[int, ...], torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(token | everything before it) at every trained position, one forward for the group.

    The prefix shared by all sequences (up to the first trained position) runs once. With
    `first_layer` > 0 the layers below it are frozen: they run without gradients, or not at
    all when every sequence's states were recorded at sampling time (`states`).
    """
    rows = len(tokens)
    first = int(targets.positions.min())
    p = min(common_prefix_length(tokens), first - 1)
    inputs = [p + 1] * rows  # positions 0 .. inputs-1 are read; the hidden state at j - 1 predicts token j
    for r, j in zip(targets.rows.tolist(), targets.positions.tolist()):
        inputs[r] = max(inputs[r], j)
    width = max(inputs) - p
    ids = torch.zeros(rows, width, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, : inputs[i] - p] = torch.tensor(list(t[p : inputs[i]]))
    valid = torch.arange(width)[None] < (torch.tensor(inputs) - p)[:, None]
    positions = p + torch.arange(width)[None].expand(rows, -1)
    if first_layer == 0:
        prefix = run_prefix(model, list(tokens[0][:p])) if p > 0 else None
        x: torch.Tensor = ids
    else:
        prefix_states, x = _trunk(model, tokens, inputs, ids, positions, valid, p, first_layer, states)
        prefix = run_prefix(model, prefix_states, layers=(first_layer, None)) if p > 0 else None
    hidden = forward_rows(model, x, positions, valid, prefix, layers=(first_layer, None)).hidden
    picked = hidden[targets.rows, targets.positions - 1 - p]
    logits = causal_lm(model).lm_head(picked).float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets.tokens[:, None])[:, 0]


def _trunk(model, tokens, inputs, ids, positions, valid, p, first_layer, states):
    """Hidden states entering `first_layer`: [P, hidden] for the prefix, [rows, width, hidden] for the rest."""
    found = [_lookup(states, t, n) for t, n in zip(tokens, inputs)] if states else [None]
    if all(f is not None for f in found):
        width = ids.shape[1]
        x = torch.zeros(len(tokens), width, found[0].shape[-1], dtype=found[0].dtype)
        for i, f in enumerate(found):
            x[i, : inputs[i] - p] = f[p : inputs[i]]
        return found[0][:p], x
    with torch.no_grad():
        trunk = run_prefix(model, list(tokens[0][:p]), layers=(0, first_layer)) if p > 0 else None
        x = forward_rows(model, ids, positions, valid, trunk, layers=(0, first_layer)).hidden
    return (trunk.output[0] if trunk is not None else x[0, :0]), x


def _lookup(states: Mapping[tuple[int, ...], torch.Tensor], seq: Sequence[int], need: int) -> torch.Tensor | None:
    """Recorded states covering the first `need` positions of `seq`, if sampling kept them
    (the sequence may end with context added after the answer, such as a closing token)."""
    for n in range(len(seq), max(need, len(seq) - 8) - 1, -1):
        hit = states.get(tuple(seq[:n]))
        if hit is not None and len(hit) >= need:
            return hit
    return None
