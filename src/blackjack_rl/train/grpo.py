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
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from blackjack_rl.config import Settings
from blackjack_rl.contract.protocol import HIT, STICK
from blackjack_rl.contract.records import ScoredDataGroup, StepRecord
from blackjack_rl.contract.tokens import MASKED
from blackjack_rl.model.logprobs import Targets, token_logprobs
from blackjack_rl.rollout.credit import decision_pull, group_advantages
from blackjack_rl.train.groups import decision_of


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # weight of KL(policy || initial model), k3 estimator
    temperature: float = 1.0  # the logprobs are of logits / temperature, as sampled
    scale_advantages: bool = True  # divide by the group's score std (GRPO); False: Dr. GRPO


@dataclass(frozen=True)
class Rows:
    """Sequences as the loss trains them: each with an advantage per token (a group's own
    per-token `advantages`, or its one advantage per sequence on every token), and the logprobs
    they were sampled with when every one of them has them."""

    tokens: list[list[int]]
    masks: list[list[int]]
    advantages: list[list[float]]
    inference_logprobs: list[list[float]] | None = None


def trained_targets(group: ScoredDataGroup | Rows) -> Targets:
    rows, positions, tokens, old = [], [], [], []
    inference = group.inference_logprobs or None
    for r, (seq, mask) in enumerate(zip(group.tokens, group.masks)):
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
    rows: Rows,
    config: LossConfig,
    reference: Callable[..., torch.Tensor] | None = None,
    *,
    first_layer: int = 0,
    states: dict[tuple[int, ...], torch.Tensor] | None = None,
) -> GroupLoss:
    """The clipped policy-gradient loss of some sequences (call `.backward()` on `.loss`).

    A sequence's loss is the sum over its tokens (the gradient of its logprob), so the
    token that decides is not diluted by the length of the answer around it.

    `reference(tokens, targets, first_layer=, states=)` gives the initial policy's logprobs for the KL term (None:
    no KL). `first_layer` and `states`: see `token_logprobs`.
    """
    targets = trained_targets(rows)
    if len(targets.rows) == 0:
        raise ValueError("a group with no trained positions (all masks -100) cannot be trained on")
    logp = token_logprobs(model, rows.tokens, targets, config.temperature, first_layer=first_layer, states=states)
    old = targets.old_logprobs if targets.old_logprobs is not None else logp.detach()
    adv = token_advantages(rows, targets)
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    kl_value = 0.0
    if config.kl_coef > 0 and reference is not None:
        with torch.no_grad():
            ref = reference(rows.tokens, targets, first_layer=first_layer, states=states)
        delta = ref - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.kl_coef * kl
        kl_value = float(kl.mean())
    n = len(rows.tokens)
    with torch.no_grad():
        clipped = float(((ratio - clipped_ratio).abs() > 1e-6).float().mean())
        gap = float((logp - old).abs().mean())
    return GroupLoss(per_token.sum(), n, len(targets.rows), clipped, gap, kl_value)


def token_advantages(rows: Rows, targets: Targets) -> torch.Tensor:
    """The per-token advantages at the trained positions."""
    values = []
    for r, j in zip(targets.rows.tolist(), targets.positions.tolist()):
        row = rows.advantages[r]
        if len(row) != len(rows.tokens[r]):
            raise ValueError(f"advantages of sequence {r} have {len(row)} entries for {len(rows.tokens[r])} tokens")
        values.append(float(row[j]))
    return torch.tensor(values, dtype=torch.float32)


def scalar_advantages(group: ScoredDataGroup, scale: bool) -> list[float] | None:
    """One advantage per sequence (group-relative), or None when the group carries its own
    per-token `advantages`, which then take precedence."""
    if group.advantages:
        return None
    return group_advantages(group.scores, scale)


def rows_of(group: ScoredDataGroup, advantages: list[float] | None) -> Rows:
    """One group's sequences as the loss trains them: with its per-sequence `advantages` on
    every token, or (None) with its own per-token advantages."""
    per_token = [list(a) for a in group.advantages] if advantages is None else [
        [a] * len(seq) for a, seq in zip(advantages, group.tokens)]
    return Rows(group.tokens, group.masks, per_token, group.inference_logprobs or None)


def merge_groups(work: Sequence[tuple[ScoredDataGroup, list[float] | None]], max_rows: int,
                 *, drop_zero: bool = False, certain: float = 0.0) -> list[Rows]:
    """The sequences of many groups as a few large batches, each with per-token advantages.

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

    `certain` (with `drop_zero`): a token sampled with probability at least 1 - `certain` is
    not trained either. Its logit gradient, A (e_t - p), has norm at most sqrt(2) * certain * |A|,
    and once a call's format is learned most of its ~20 tokens are such tokens, each of
    which would cost a full-vocabulary LM head forward and backward.
    """
    floor = math.log1p(-certain) if certain > 0 else None
    rows: dict[bool, list[tuple[list[int], list[int], list[float] | None, list[float]]]] = {True: [], False: []}
    for group, adv in work:
        inference = group.inference_logprobs or None
        for r, (seq, mask) in enumerate(zip(group.tokens, group.masks)):
            per_token = list(group.advantages[r]) if adv is None else [adv[r]] * len(seq)
            if drop_zero:
                mask = [m if a != 0.0 else MASKED for m, a in zip(mask, per_token)]
                if floor is not None and inference:
                    mask = [m if lp < floor else MASKED for m, lp in zip(mask, inference[r])]
                if all(m == MASKED for m in mask):
                    continue
            rows[inference is not None].append((seq, mask, inference[r] if inference else None, per_token))
    merged = []
    for has_logprobs, items in rows.items():
        items.sort(key=lambda item: item[0])
        for i in range(0, len(items), max(1, max_rows)):
            chunk = items[i : i + max_rows]
            merged.append(Rows([c[0] for c in chunk], [c[1] for c in chunk], [c[3] for c in chunk],
                               [c[2] for c in chunk] if has_logprobs else None))
    return merged


def carries_signal(group: ScoredDataGroup, advantages: list[float] | None) -> bool:
    if advantages is not None:
        return any(a != 0.0 for a in advantages)
    return any(v != 0.0 for row, m in zip(group.advantages, group.masks) for v, k in zip(row, m) if k != MASKED)


def action_balance(groups: Sequence[ScoredDataGroup], by_turn: bool = False,
                   pull: Callable[[ScoredDataGroup], float] | None = None) -> list[float]:
    """A weight per group so that the batch's decisions where hitting is optimal and those where
    sticking is optimal weigh the same in total (1.0 for groups that are not decisions).
    `by_turn` balances first decisions and later ones (after a hit) apart, each set keeping
    its own total weight. With `pull` (`--balance-by credit`) the classes weigh the same in
    summed |pull|, each decision's credit on the hit/stick logit difference, instead of in number.

    Why: a policy that cannot yet tell hands apart can still raise the batch's decision credit
    by moving one shared hit/stick preference toward the more common class, and that is what
    it learns first. Measured on SmolLM2-135M over the strategy chart (docs/training/): with 61%
    of the states hit-optimal it went to always hitting in 5 steps; with the two classes weighed
    equally, a shared preference earns nothing and the gap between the classes grew instead.
    Later decisions are mostly stick-optimal, so without `by_turn` "I have hit before" is such
    a preference, and the model learned it instead of reading the hand. Equal numbers still
    leave a net pull where one class's credits are larger (clearer gaps, or a less sure
    policy there); equal pulls leave none.
    """
    decisions = [decision_of(g) for g in groups]
    keys = [None if d is None else ((d.decision > 0) if by_turn else False, better_action(d)) for d in decisions]
    mass = [0.0 if k is None else abs(pull(g)) if pull is not None else 1.0 for g, k in zip(groups, keys)]
    weights = [1.0] * len(groups)
    for later in {k[0] for k in keys if k is not None}:
        totals = {a: sum(m for k, m in zip(keys, mass) if k == (later, a)) for a in ("hit", "stick")}
        if not totals["hit"] or not totals["stick"]:
            continue  # one class only (or no pull in one): nothing to balance against
        total = totals["hit"] + totals["stick"]
        for i, k in enumerate(keys):
            if k is not None and k[0] == later:
                weights[i] = total / (2 * totals[k[1]])
    return weights


def credit_pull(group: ScoredDataGroup, settings: Settings) -> float:
    """The pull of a counterfactual group's decision credit on z_hit - z_stick, as its credit was
    computed (the estimates or Q*, the policy's p_call, the scaling and forced weight it records)."""
    d = decision_of(group)
    if d is None or d.p_call is None:
        return 0.0
    q = d.q_estimate if d.q_estimate is not None else d.q
    return decision_pull((q["stick"], q["hit"]), {HIT: d.p_call["hit"], STICK: d.p_call["stick"]},
                         settings.groups.scale_decisions, (d.q_estimate or {}).get("se_gap", 0.0),
                         group.generation_params.get("forced_weight", "policy"))


def better_action(decision: StepRecord) -> str:
    """The class `action_balance` puts a decision in: the optimal action, or, in a group credited
    by rollouts (reward only), the action its own estimate values higher, so that no solver
    output weighs the batch."""
    q = decision.q_estimate
    if q is not None:
        return "hit" if q["hit"] > q["stick"] else "stick"
    return decision.optimal


def weighted(group: ScoredDataGroup, advantages: list[float] | None, weight: float
             ) -> tuple[ScoredDataGroup, list[float] | None]:
    """The group and its advantages with the advantages multiplied by `weight`."""
    if weight == 1.0:
        return group, advantages
    if advantages is not None:
        return group, [weight * a for a in advantages]
    return group.model_copy(update={"advantages": [[weight * v for v in row] for row in group.advantages]}), None


def optimize(
    model: Any,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    groups: Sequence[ScoredDataGroup],
    loss_config: LossConfig,
    settings: Settings,
    reference: Callable[..., torch.Tensor] | None,
    first_layer: int = 0,
    states: dict[tuple[int, ...], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One GRPO step on a batch of groups (several when --updates-per-batch > 1).

    Groups whose scores are all equal have zero advantage everywhere and are skipped: they
    would cost a forward and backward pass for a zero gradient. The others are trained
    together (`merge_groups`: the shared system prompt runs once per forward), and each
    forward is backpropagated as soon as its loss is known, so memory holds one graph at a time.
    """
    work = []
    balance = settings.groups
    pull = (lambda g: credit_pull(g, settings)) if balance.balance_by == "credit" else None
    weights = action_balance(groups, balance.balance_later, pull) if balance.balance_actions else [1.0] * len(groups)
    for g, w in zip(groups, weights):
        adv = scalar_advantages(g, loss_config.scale_advantages)
        if carries_signal(g, adv):
            work.append(weighted(g, adv, w))
    stats: dict[str, Any] = {"trained_groups": len(work), "trained_sequences": sum(len(g.tokens) for g, _ in work)}
    if not work:
        return stats
    t0 = time.perf_counter()
    # The whole batch, groups without signal included: a batch whose only signal is one
    # invalid answer then makes a small step, not a full-size one.
    sequences = sum(len(g.tokens) for g in groups)
    merged = merge_groups(work, settings.train.max_train_rows, drop_zero=loss_config.kl_coef == 0,
                          certain=settings.train.skip_certain)
    processed = 0
    for _ in range(settings.train.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = gap = kl = 0.0
        tokens = 0
        for rows in merged:
            gl = group_loss(model, rows, loss_config, reference, first_layer=first_layer, states=states)
            (gl.loss / sequences).backward()
            loss_sum += float(gl.loss.detach()) / sequences
            tokens += gl.tokens
            clipped += gl.clipped * gl.tokens
            gap += gl.logprob_gap * gl.tokens
            kl += gl.kl * gl.tokens
            processed += sum(len(t) for t in rows.tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.train.max_grad_norm)
        optimizer.step()
    seconds = time.perf_counter() - t0
    stats.update(
        loss=loss_sum,
        trained_tokens=tokens,
        clipped=clipped / tokens,
        logprob_gap=gap / tokens,
        kl=kl / tokens if settings.train.kl_coef > 0 else None,
        grad_norm=float(grad_norm),
        train_seconds=seconds,
        train_tokens_per_s=processed / seconds if seconds > 0 else None,
    )
    return stats
