"""Which episodes a report embeds, and how: a bounded, varied sample with compact records.

A 20,000-episode run would make a page too heavy to open, and the first few hundred
deals may hold no invalid answer or no mistake at all; so the sample takes some of
every kind (each invalid reason, wrong decisions, the rest), in seed order.
"""

from __future__ import annotations

from typing import Any, Iterable

from blackjack_rl.contract.records import SCORED_AS_INVALID, SampleRow, Status

Row = SampleRow


def has_mistake(row: Row) -> bool:
    return any(d.action is not None and d.action != d.optimal for d in row.decisions)


def category(row: Row) -> str:
    if row.status == Status.FAILED:
        return "failed"
    if row.status in SCORED_AS_INVALID:
        return f"invalid:{row.invalid_reason}"
    return "mistake" if has_mistake(row) else "optimal"


def sample(rows: Iterable[Row], limit: int = 400) -> list[Row]:
    """Up to `limit` episodes: every category gets an even share of the budget, unused
    shares go to the next category, and the result is in seed order."""
    buckets: dict[str, list[Row]] = {}
    for row in rows:
        bucket = buckets.setdefault(category(row), [])
        if len(bucket) < limit:
            bucket.append(row)
    chosen: list[Row] = []
    names = sorted(buckets, key=lambda k: len(buckets[k]))  # small categories first, so they fit whole
    budget = limit
    for i, name in enumerate(names):
        share = budget // (len(names) - i)
        take = buckets[name][:share]
        chosen.extend(take)
        budget -= len(take)
    return sorted(chosen, key=lambda r: r.seed)


def compact(row: Row, system_prompts: list[str]) -> dict[str, Any]:
    """What the episode browser shows. The system prompt is the same for (almost) every
    episode, so it is stored once per page and referenced by index."""
    messages = []
    for m in row.messages:
        if m.get("role") == "system":
            content = m.get("content", "")
            if content not in system_prompts:
                system_prompts.append(content)
            messages.append(["system", system_prompts.index(content)])
        else:
            messages.append([m.get("role", "?"), m.get("content", "")])
    return {
        "seed": row.seed,
        "status": row.status,
        "outcome": row.outcome,
        "reward": row.reward,
        "score": row.score,
        "reason": row.invalid_reason,
        "error": row.error,
        "player": row.player_hand,
        "dealer": row.dealer_hand,
        "category": category(row),
        "decisions": [
            {"state": d.state, "action": d.action, "optimal": d.optimal, "regret": d.regret, "error": d.parse_error}
            for d in row.decisions
        ],
        "messages": messages,
    }


def invalid_examples(rows: Iterable[Row], per_reason: int = 3) -> dict[str, list[dict[str, Any]]]:
    """Real answers behind each invalid reason: the text the parser refused and why."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        reason = row.invalid_reason
        if row.status not in SCORED_AS_INVALID or not reason:
            continue
        examples = out.setdefault(reason, [])
        if len(examples) >= per_reason:
            continue
        last = row.decisions[-1] if row.decisions else None
        examples.append({"seed": row.seed, "text": last.text if last else "",
                         "error": last.parse_error if last else None, "state": last.state if last else None})
    return out
