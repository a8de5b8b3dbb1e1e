"""The model's logprob of given tokens: what the torch policy scores answers with, and what the
trainer's loss differentiates, so that sampled, scored and trained logprobs are one computation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.model.forward import causal_lm, forward_rows, run_prefix

MAX_BRANCHES = 32  # sequences packed into one row: its attention mask grows with the square of its width


@dataclass
class Targets:
    """Trained positions of a group, flattened: row, position, token, logprob when sampled."""

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    old_logprobs: torch.Tensor | None  # None when the group carries none usable


@dataclass
class Packed:
    """Sequences laid out as fewer rows, each row one sequence's tokens followed by the tokens
    of others that share its start, from where they part (their shared start runs once).

    `ids`, `positions`, `valid`, `attend`: the rows as `forward_rows` takes them, from position
    `start` on. `where[r]` = (row, split, offset, end) for sequence r: its positions below `split`
    are the columns of the row's first sequence, the rest (up to `end`) its own columns from
    `offset` on. The row's first sequence has offset 0 and split = end.
    """

    ids: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [rows, width]
    valid: torch.Tensor  # [rows, width]
    attend: torch.Tensor  # [rows, width, width]
    start: int
    where: list[tuple[int, int, int, int]]

    def column(self, seq: int, position: int) -> tuple[int, int]:
        """(row, column) holding the state of `seq` at `position`."""
        row, split, offset, _ = self.where[seq]
        return row, (position - self.start if position < split else offset + position - split)

    def unpack(self, hidden: torch.Tensor, seq: int) -> torch.Tensor:
        """The states of `seq` alone, from the packed rows' `hidden` [rows, width, ...]."""
        row, split, offset, end = self.where[seq]
        return torch.cat([hidden[row, : split - self.start], hidden[row, offset : offset + end - split]])


def pack_rows(tokens: Sequence[Sequence[int]], inputs: Sequence[int], p: int) -> Packed:
    """Lay out `tokens[r][p:inputs[r]]` so that what sequences share beyond `p` runs once.

    Why: the rows of a training forward are mostly siblings, the answers of one prompt (a step
    group's answers after the conversation so far, or a decision's hit and stick calls, which
    differ from the action word on). Causal attention makes a token's state depend only on the
    tokens before it, so where sequences agree their states are equal: each row holds one
    sequence, then the other sequences' own tokens from where they leave it, each seeing the
    shared start and itself only. The states, logprobs and gradients are those of separate rows;
    the work is that of the tokens that differ.
    """
    n = len(tokens)
    order = sorted(range(n), key=lambda r: tuple(tokens[r][p : inputs[r]]))
    groups, widths = _branch(order, tokens, inputs, p, None)
    if len(groups) * max(widths) >= n * (max(inputs) - p):
        # every row is padded to the widest: rows grown wider than any one sequence cost more than
        # they save (histories that share all but their last turn make such rows), so no row
        # may outgrow the longest sequence
        groups, widths = _branch(order, tokens, inputs, p, max(inputs) - p)
    width = max(widths)
    rows = len(groups)
    ids = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    attend = torch.zeros(rows, width, width, dtype=torch.bool)
    where: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * n
    for i, g in enumerate(groups):
        head = g[0][0]
        m = inputs[head] - p
        ids[i, :m] = torch.tensor(list(tokens[head][p : inputs[head]]))
        positions[i, :m] = torch.arange(p, inputs[head])
        attend[i, :m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
        where[head] = (i, inputs[head], 0, inputs[head])
        at = m
        for r, split in g[1:]:
            k = inputs[r] - split
            if k:
                ids[i, at : at + k] = torch.tensor(list(tokens[r][split : inputs[r]]))
                positions[i, at : at + k] = torch.arange(split, inputs[r])
                attend[i, at : at + k, : split - p] = True  # the start it shares with the row's first
                attend[i, at : at + k, at : at + k] = torch.ones(k, k, dtype=torch.bool).tril()
            where[r] = (i, split, at, inputs[r])
            at += k
        valid[i, :at] = True
    return Packed(ids, positions, valid, attend, p, where)


def _branch(order: Sequence[int], tokens: Sequence[Sequence[int]], inputs: Sequence[int], p: int,
            cap: int | None) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """The rows of `pack_rows`: per row, (sequence, where it leaves the row's first), and the
    row's width; with `cap`, a sequence joins a row only while the row stays that narrow."""
    groups: list[list[tuple[int, int]]] = []
    widths: list[int] = []
    for r in order:
        if groups and len(groups[-1]) < MAX_BRANCHES:
            head = groups[-1][0][0]
            shared = p + common_prefix_length([tokens[head][p : inputs[head]], tokens[r][p : inputs[r]]])
            # only where it saves at least the tokens it adds to the row (unrelated sequences
            # share a few tokens of chat markup, and a wide row costs attention for all)
            own = inputs[r] - shared
            if shared - p >= own and (cap is None or widths[-1] + own <= cap):
                groups[-1].append((r, shared))
                widths[-1] += own
                continue
        groups.append([(r, inputs[r])])
        widths.append(inputs[r] - p)
    return groups, widths


def token_logprobs(
    model: Any,
    tokens: Sequence[Sequence[int]],
    targets: Targets,
    temperature: float,
    *,
    first_layer: int = 0,
    states: Mapping[tuple[int, ...], torch.Tensor] | None = None,
    prefixes: dict[tuple[int, ...], Any] | None = None,
) -> torch.Tensor:
    """log p(token | everything before it) at every trained position, one forward for the group.

    The prefix shared by all sequences (up to the first trained position) runs once, and what
    fewer of them share runs once too (`pack_rows`). With `first_layer` > 0 the layers below it
    are frozen: they run without gradients, or not at all when every sequence's states were
    recorded at sampling time (`states`). `prefixes` keeps the shared prefix's run for the next
    call with the same prefix: only while the weights stay as they are, and without gradients.
    """
    rows = len(tokens)
    first = int(targets.positions.min())
    p = min(common_prefix_length(tokens), first - 1)
    inputs = [p + 1] * rows  # positions 0 .. inputs-1 are read; the hidden state at j - 1 predicts token j
    for r, j in zip(targets.rows.tolist(), targets.positions.tolist()):
        inputs[r] = max(inputs[r], j)
    if prefixes is not None and torch.is_grad_enabled():
        raise ValueError("a kept prefix carries no gradients: pass `prefixes` only under torch.no_grad()")
    packed = pack_rows(tokens, inputs, p)
    key = tuple(tokens[0][:p])
    x: torch.Tensor
    if first_layer == 0:
        prefix_input, x = list(key), packed.ids
    else:
        prefix_input, x = _trunk(model, tokens, inputs, packed, p, first_layer, states)
    prefix = prefixes.get(key) if prefixes is not None else None
    if prefix is None and p > 0:
        prefix = run_prefix(model, prefix_input, layers=(first_layer, None))
        if prefixes is not None:
            prefixes[key] = prefix
    hidden = forward_rows(model, x, packed.positions, packed.valid, prefix, layers=(first_layer, None),
                          attend=packed.attend).hidden
    # Sequences that share a start share its states (`pack_rows`), so targets there read the same
    # cell: in a scoring, which reads every position of both calls, the vocabulary head and its
    # softmax (most of its cost) run once per cell. A training step reads few positions (the sure
    # ones are skipped) and keeps a row per target.
    cells = [packed.column(r, j - 1) for r, j in zip(targets.rows.tolist(), targets.positions.tolist())]
    unique = list(dict.fromkeys(cells)) if not torch.is_grad_enabled() else cells
    picked = hidden[torch.tensor([c[0] for c in unique]), torch.tensor([c[1] for c in unique])]
    logits = causal_lm(model).lm_head(picked).float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    if unique is cells:
        return logp.gather(1, targets.tokens[:, None])[:, 0]
    index = {c: i for i, c in enumerate(unique)}
    return logp[torch.tensor([index[c] for c in cells]), targets.tokens]


def _trunk(model, tokens, inputs, packed: Packed, p, first_layer, states):
    """Hidden states entering `first_layer`: [P, hidden] for the prefix, [rows, width, hidden] for the rest."""
    found = [_lookup(states, t, n) for t, n in zip(tokens, inputs)] if states else [None]
    if all(f is not None for f in found):
        x = torch.zeros(*packed.ids.shape, found[0].shape[-1], dtype=found[0].dtype)
        for f, (row, split, offset, end) in zip(found, packed.where):
            if offset == 0:  # a row's first sequence: the start it shares with the others
                x[row, : split - p] = f[p:split]
            x[row, offset : offset + end - split] = f[split:end]
        return found[0][:p], x
    with torch.no_grad():
        trunk = run_prefix(model, list(tokens[0][:p]), layers=(0, first_layer)) if p > 0 else None
        x = forward_rows(model, packed.ids, packed.positions, packed.valid, trunk, layers=(0, first_layer),
                         attend=packed.attend).hidden
    return (trunk.output[0] if trunk is not None else x[0, :0]), x


def _lookup(states: Mapping[tuple[int, ...], torch.Tensor], seq: Sequence[int], need: int) -> torch.Tensor | None:
    """Recorded states covering the first `need` positions of `seq`, if sampling kept them
    (the sequence may end with context added after the answer, such as a closing token)."""
    for n in range(len(seq), max(need, len(seq) - 8) - 1, -1):
        hit = states.get(tuple(seq[:n]))
        if hit is not None and len(hit) >= need:
            return hit
    return None
