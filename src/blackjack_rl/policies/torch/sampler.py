"""Batched sampling from a torch model, exact ids and the logprob each was sampled with.

All rows of a batch share the longest common prefix of their prompts (a group's prompt, or
at least the system prompt), which runs once; each row then carries its own suffix, padded on
the right and never attended to where padded. Finished rows leave the batch.

Each row draws from its own seeded generator, so a row's answer does not depend on which
other rows share its batch (up to floating-point differences between batch shapes).

With `record_layer`, each sample also keeps the hidden states entering that layer at every
position the model read (prompt and answer but its last token): when only the layers from
there up are trained, the trainer starts from these instead of running the frozen trunk again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.model.forward import Prefix, RowCache, RowsOutput, causal_lm, forward_rows, run_prefix


@dataclass
class Sample:
    ids: list[int]  # ends with the stop token when the answer stopped
    logprobs: list[float]  # log-probability of each id under the sampling distribution
    finish_reason: str  # "stop" or "length"
    states: torch.Tensor | None = None  # [len(prompt) + len(ids) - 1, hidden] entering `record_layer`


@torch.no_grad()
def sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_new_tokens: int,
    stop: set[int],
    pad_id: int = 0,
    record_layer: int | None = None,
) -> list[Sample]:
    """Sample one answer per prompt. temperature 0 means greedy (logprobs then at temperature 1).

    top_k, top_p and min_p (in that order, as vLLM applies them) cut the tempered distribution
    before the draw; the logprobs stay those of the tempered distribution, uncut, which is
    what `token_logprobs` computes for the trainer's importance ratio.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lm = causal_lm(model)
    n = len(prompts)
    prefix, first, cache, lengths, next_pos = _prefill(model, prompts, max_new_tokens, pad_id, record_layer)
    logits = lm.lm_head(first.hidden[torch.arange(n), lengths - 1])
    recorded: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per row, the states of fed answer tokens

    rngs = [np.random.default_rng(int(s) & 0xFFFFFFFFFFFFFFFF) for s in seeds]
    out = [Sample([], [], "length") for _ in range(n)]
    active = torch.arange(n)  # original row of each row still in the batch
    stop_t = torch.tensor(sorted(stop)) if stop else torch.tensor([], dtype=torch.long)
    for step in range(max_new_tokens):
        logits = logits.float()
        if temperature > 0:
            u = torch.tensor([rngs[int(r)].random() for r in active], dtype=torch.float64)
            tok, logp = draw(logits, u, temperature, top_p, top_k, min_p)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(-1, keepdim=True)
        lp = logp.gather(1, tok)[:, 0]
        tok = tok[:, 0]
        for j, r in enumerate(active.tolist()):
            out[r].ids.append(int(tok[j]))
            out[r].logprobs.append(float(lp[j]))
        done = torch.isin(tok, stop_t)
        for r in active[done].tolist():
            out[r].finish_reason = "stop"
        if step == max_new_tokens - 1:
            break
        keep = ~done
        if not bool(keep.any()):
            break
        if not bool(keep.all()):
            rows = keep.nonzero()[:, 0]
            cache.keep_rows(rows)
            active, tok, next_pos = active[rows], tok[rows], next_pos[rows]
        step_out = forward_rows(
            model, tok[:, None], next_pos[:, None], torch.ones(len(active), 1, dtype=torch.bool), prefix, cache,
            record_layer=record_layer,
        )
        if record_layer is not None:
            for j, r in enumerate(active.tolist()):
                recorded[r].append(step_out.recorded[j])
        logits = lm.lm_head(step_out.hidden[:, -1])
        next_pos = next_pos + 1
    if record_layer is not None:
        head = prefix.recorded[0] if prefix is not None else first.recorded[0, :0]
        for i in range(n):
            out[i].states = torch.cat([head, first.recorded[i, : int(lengths[i])], *recorded[i]])
    return out


def _prefill(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
             record_layer: int | None) -> tuple[Prefix | None, RowsOutput, RowCache, torch.Tensor, torch.Tensor]:
    """Run the prompts: their longest common prefix once, then each row's own suffix (padded on the
    right) into a cache with room for the answer. Returns the prefix, the suffixes' output, the
    cache, each row's suffix length and the position of its first answer token."""
    lm = causal_lm(model)
    n = len(prompts)
    p = min(common_prefix_length(prompts), min(len(x) for x in prompts) - 1)  # each row keeps >= 1 token
    prefix = run_prefix(model, list(prompts[0][:p]), record_layer=record_layer)
    lengths = torch.tensor([len(x) - p for x in prompts])
    width = int(lengths.max())
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, : len(x) - p] = torch.tensor(list(x[p:]))
    valid = torch.arange(width)[None] < lengths[:, None]
    positions = p + torch.arange(width)[None].expand(n, -1)
    cache = RowCache.allocate(model, n, width + max_new_tokens, lm.lm_head.weight.dtype)
    first = forward_rows(model, ids, positions, valid, prefix, cache, record_layer=record_layer)
    return prefix, first, cache, lengths, p + lengths


def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
         min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [rows, vocab], by inverse CDF at the uniform draws `u`
    [rows], from the tempered distribution cut by top-k / top-p / min-p. Returns the ids
    [rows, 1] and the tempered, uncut log-probabilities [rows, vocab]."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.double().exp()
    if top_p < 1.0 or top_k > 0 or min_p > 0.0:
        probs = truncate(probs, top_p, top_k, min_p)
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=logits.shape[-1] - 1)
    return tok, logp


def truncate(probs: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """`probs` [rows, vocab] with the tokens top-k, top-p and min-p leave out set to zero (not
    renormalized: the draw scales by the total). The most likely token always stays."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        keep &= probs >= kth
    if top_p < 1.0:
        sorted_p, order = (probs * keep).sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        inside = before < top_p * sorted_p.sum(-1, keepdim=True)
        keep &= torch.zeros_like(keep).scatter(-1, order, inside)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    return probs * keep

