"""The groups the trainer works on: `contract.records.ScoredDataGroup`, typed, from either source.

Groups played here are typed already. A batch pulled from the trajectory API is JSON, and any
environment may have posted into it, so `read_group` reads each group into the same record:
ours with their `episodes` records (typed by the kind of group they say they are), another
environment's with none. The trainer reads no messages, so they are not read back (another
environment's need not have our shape).
"""

from __future__ import annotations

from typing import Any, Mapping

from blackjack_rl.contract.records import ScoredDataGroup, SequenceRecord, StepRecord, sequence_records

# What training reads of a group; anything else a batch carries is dropped on reading.
_TRAINED = ("tokens", "masks", "scores", "advantages", "inference_logprobs", "generation_params", "overrides",
            "group_overrides")


def read_group(data: Mapping[str, Any]) -> ScoredDataGroup:
    """A group as JSON (a batch from the API) as the typed record."""
    try:
        records = sequence_records(data) or []
    except ValueError:  # pydantic's ValidationError: another environment's `episodes`
        records = []
    fields = {name: data[name] for name in _TRAINED if data.get(name) is not None}
    return ScoredDataGroup.model_validate(
        {"inference_logprobs": [], "generation_params": {}, **fields, "messages": [], "episodes": records})


def records_of(group: ScoredDataGroup) -> list[SequenceRecord | None]:
    """One record per sequence; None for each sequence of a group that carries none of ours."""
    return list(group.episodes) or [None for _ in group.scores]


def decision_of(group: ScoredDataGroup) -> StepRecord | None:
    """The decision a step group is about (its first record), or None for any other group."""
    first = group.episodes[0] if group.scores and group.episodes else None
    return first if isinstance(first, StepRecord) else None
