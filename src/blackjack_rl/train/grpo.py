"""GRPO: group-relative advantages and a clipped policy-gradient loss on trained tokens only.

A group is answers to one prompt (one deal, or one decision), so its mean score is the
baseline: an answer is pushed up exactly when it beat its siblings. Only positions whose
mask is a token id (the model's own sampled tokens) are trained; the prompt, the
environment's text and padding never are. The importance ratio compares the current
policy with the logprobs the answer was sampled with (`inference_logprobs`), clipped as in
PPO, so stale or off-policy samples (several updates per batch, or an inference server
that has not loaded the new weights) cannot move the policy far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from blackjack_rl.policies.torch.logprobs import Targets, token_logprobs
from blackjack_rl.contract.records import decision_record
from blackjack_rl.contract.tokens import MASKED


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # weight of KL(policy || initial model), k3 estimator
    temperature: float = 1.0  # the logprobs are of logits / temperature, as sampled
    scale_advantages: bool = True  # divide by the group's score std (GRPO); False: Dr. GRPO


def group_advantages(scores: Sequence[float], scale: bool = True) -> list[float]:
    """score - group mean, divided by the group's std when `scale` (all zero when scores are equal)."""
    n = len(scores)
    mean = sum(scores) / n
    centred = [s - mean for s in scores]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / std if std > 1e-8 else 0.0 for c in centred]


def trained_targets(group: Mapping[str, Any]) -> Targets:
    rows, positions, tokens, old = [], [], [], []
    inference = group.get("inference_logprobs") or None
    for r, (seq, mask) in enumerate(zip(group["tokens"], group["masks"])):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {r} has {len(seq)} tokens but {len(mask)} mask entries")
        for j, m in enumerate(mask):
            if m != MASKED:
                if j == 0:
                    raise ValueError("the first token of a sequence cannot be trained: nothing predicts it")
                rows.append(r)
                positions.append(j)
                tokens.append(seq[j])
                if inference:
                    old.append(inference[r][j])
    usable = bool(inference) and len(old) == len(rows) and any(x != 0.0 for x in old) and all(x <= 0.0 for x in old)
    return Targets(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(positions, dtype=torch.long),
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(old, dtype=torch.float32) if usable else None,
    )


@dataclass
class GroupLoss:
    loss: torch.Tensor  # sum over trained tokens (divide by the batch's sequences: a sequence's logprob gradient)
    sequences: int
    tokens: int
    clipped: float  # share of trained tokens whose ratio was clipped
    logprob_gap: float  # mean |new - sampled| logprob: 0 on-policy, grows with staleness
    kl: float  # mean k3 estimate of KL(policy || reference)


def group_loss(
    model: Any,
    group: Mapping[str, Any],
    advantages: Sequence[float] | None,
    config: LossConfig,
    reference: Callable[[Sequence[Sequence[int]], Targets], torch.Tensor] | None = None,
    *,
    first_layer: int = 0,
    states: Mapping[tuple[int, ...], torch.Tensor] | None = None,
) -> GroupLoss:
    """The clipped policy-gradient loss of one group (call `.backward()` on `.loss`).

    `advantages` are one per sequence; None uses the group's per-token `advantages`.
    A sequence's loss is the sum over its tokens (the gradient of its logprob), so the
    token that decides is not diluted by the length of the answer around it.

    `reference(tokens, targets, first_layer=, states=)` gives the initial policy's logprobs for the KL term (None:
    no KL). `first_layer` and `states`: see `token_logprobs`.
    """
    targets = trained_targets(group)
    if len(targets.rows) == 0:
        raise ValueError("a group with no trained positions (all masks -100) cannot be trained on")
    logp = token_logprobs(model, group["tokens"], targets, config.temperature, first_layer=first_layer, states=states)
    old = targets.old_logprobs if targets.old_logprobs is not None else logp.detach()
    if advantages is None:
        adv = token_advantages(group, targets)
    else:
        adv = torch.tensor(advantages, dtype=torch.float32)[targets.rows]
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    kl_value = 0.0
    if config.kl_coef > 0 and reference is not None:
        with torch.no_grad():
            ref = reference(group["tokens"], targets, first_layer=first_layer, states=states)
        delta = ref - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.kl_coef * kl
        kl_value = float(kl.mean())
    rows = len(group["tokens"])
    with torch.no_grad():
        clipped = float(((ratio - clipped_ratio).abs() > 1e-6).float().mean())
        gap = float((logp - old).abs().mean())
    return GroupLoss(per_token.sum(), rows, len(targets.rows), clipped, gap, kl_value)


def token_advantages(group: Mapping[str, Any], targets: Targets) -> torch.Tensor:
    """The group's own per-token `advantages` at the trained positions."""
    table = group.get("advantages")
    if not table:
        raise ValueError("the group carries no per-token advantages; pass scalar advantages instead")
    values = []
    for r, j in zip(targets.rows.tolist(), targets.positions.tolist()):
        row = table[r]
        if len(row) != len(group["tokens"][r]):
            raise ValueError(f"advantages of sequence {r} have {len(row)} entries for {len(group['tokens'][r])} tokens")
        values.append(float(row[j]))
    return torch.tensor(values, dtype=torch.float32)


def scalar_advantages(group: Mapping[str, Any], scale: bool) -> list[float] | None:
    """One advantage per sequence (group-relative), or None when the group carries its own
    per-token `advantages`, which then take precedence."""
    if group.get("advantages"):
        return None
    return group_advantages(group["scores"], scale)


def merge_groups(work: Sequence[tuple[Mapping[str, Any], list[float] | None]], max_rows: int,
                 *, drop_zero: bool = False) -> list[dict[str, Any]]:
    """The sequences of many groups as a few large ones, each with per-token advantages.

    A sequence's loss depends on its own group only through its advantages, so once those
    are computed the groups can be trained together: one forward per `max_rows` sequences,
    and the prompt every sequence shares (the system prompt and tool schema, ~370 tokens)
    runs once for all of them instead of once per group. Sequences are sorted by content, so
    that siblings (the answers of one prompt, a decision's two calls) share a forward and run
    their common start once (`logprobs.pack_rows`). Groups with and without sampling logprobs
    are kept apart (an importance ratio needs them for every sequence of a forward).

    `drop_zero` (no KL term): a token whose advantage is 0 has a zero gradient whatever its
    ratio, so it is not trained, and neither is the part of a sequence after its last trained
    token. With the format unweighted (`--format-weight 0`), a decision's two calls are then
    trained up to their action word only, which they share up to: one row for the pair.
    """
    rows: dict[bool, list[tuple[list[int], list[int], list[float] | None, list[float]]]] = {True: [], False: []}
    for group, adv in work:
        inference = group.get("inference_logprobs") or None
        for r, (seq, mask) in enumerate(zip(group["tokens"], group["masks"])):
            per_token = list(group["advantages"][r]) if adv is None else [adv[r]] * len(seq)
            if drop_zero:
                mask = [m if a != 0.0 else MASKED for m, a in zip(mask, per_token)]
                if all(m == MASKED for m in mask):
                    continue
            rows[inference is not None].append((seq, mask, inference[r] if inference else None, per_token))
    merged = []
    for has_logprobs, items in rows.items():
        items.sort(key=lambda item: item[0])
        for i in range(0, len(items), max(1, max_rows)):
            chunk = items[i : i + max_rows]
            group = {"tokens": [c[0] for c in chunk], "masks": [c[1] for c in chunk],
                     "advantages": [c[3] for c in chunk]}
            if has_logprobs:
                group["inference_logprobs"] = [c[2] for c in chunk]
            merged.append(group)
    return merged


def carries_signal(group: Mapping[str, Any], advantages: list[float] | None) -> bool:
    if advantages is not None:
        return any(a != 0.0 for a in advantages)
    return any(v != 0.0 for row, m in zip(group["advantages"], group["masks"]) for v, k in zip(row, m) if k != MASKED)


def action_balance(groups: Sequence[Mapping[str, Any]]) -> list[float]:
    """A weight per group so that the batch's decisions where hitting is optimal and those where
    sticking is optimal weigh the same in total (1.0 for groups that are not decisions).

    Why: a policy that cannot yet tell hands apart can still raise the batch's decision credit
    by moving one shared hit/stick preference toward the more common class, and that is what
    it learns first. Measured on SmolLM2-135M over the strategy chart (docs/training/): with 61%
    of the states hit-optimal it went to always hitting in 5 steps; with the two classes weighed
    equally, a shared preference earns nothing and the gap between the classes grew instead.
    """
    optimal = [d.optimal if (d := decision_record(g)) is not None else None for g in groups]
    counts = {a: optimal.count(a) for a in ("hit", "stick")}
    total = counts["hit"] + counts["stick"]
    if not counts["hit"] or not counts["stick"]:
        return [1.0] * len(groups)  # one class only: nothing to balance against
    return [total / (2 * counts[a]) if a in counts else 1.0 for a in optimal]


def weighted(group: Mapping[str, Any], advantages: list[float] | None, weight: float
             ) -> tuple[Mapping[str, Any], list[float] | None]:
    """The group and its advantages with the advantages multiplied by `weight`."""
    if weight == 1.0:
        return group, advantages
    if advantages is not None:
        return group, [weight * a for a in advantages]
    return {**group, "advantages": [[weight * v for v in row] for row in group["advantages"]]}, None
