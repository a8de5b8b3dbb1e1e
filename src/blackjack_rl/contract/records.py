"""The records blackjack-rl writes and reads back: groups, their per-sequence metadata,
samples.jsonl rows and metrics.json.

Every writer builds these and every reader (the viewer, the report, `compare`, the trainer's
metrics) reads them, so a field cannot be renamed in one place and silently read as missing in
another. Field order is the order of the keys on disk and on the wire: dumping a record gives
the same JSON, byte for byte, as the dicts these records replaced.

A group's per-sequence metadata has two shapes: a whole episode (`EpisodeRecord`) or one
decision of a step group (`StepRecord`). Which one a group holds is said by the group itself
(`generation_params["group_by"]`), never guessed from the keys a record happens to have.

`api/models.py` keeps its own, stricter and more general reading of posted groups (any
environment may post); a group built here must pass it (tests/test_records.py checks that).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, SkipValidation, model_serializer

from blackjack_rl.game.table import HIT, STICK, Observation, Rules


class _Reason(StrEnum):
    """Written, compared and printed as its string, so a dict of counts by reason reads as it did."""

    def __repr__(self) -> str:
        return repr(self.value)


class Status(_Reason):
    """How an episode stands: still playing, or the reason it ended.

    `invalid` (an answer that was not a usable call: scored, since that is what RL must fix),
    `truncated` (a turn or token budget ran out: scored like invalid) and `failed` (no answer
    could be obtained: never scored, never counted as a game) are kept apart from `finished`
    (a game result) because they mean different things.
    """

    PLAYING = "playing"
    FINISHED = "finished"
    INVALID = "invalid"
    TRUNCATED = "truncated"
    FAILED = "failed"


#: Ended without a game result but with a score: counted as an invalid answer.
SCORED_AS_INVALID = frozenset({Status.INVALID, Status.TRUNCATED})


class Outcome(_Reason):
    WIN = "win"
    DRAW = "draw"
    LOSS = "loss"


class Truncation(_Reason):
    """Why a truncated episode stopped (its `invalid_reason`)."""

    CONTEXT_LIMIT = "context_limit"
    TURN_LIMIT = "turn_limit"


class DropReason(_Reason):
    """Why a played group was not emitted."""

    FAILED_EPISODES = "failed_episodes"  # a group with a hole would change GRPO's baseline
    EQUAL_SCORES = "equal_scores"  # no signal (only with --drop-equal-scores)


Action = Literal["hit", "stick"]


class Record(BaseModel):
    """A record read back ignores keys it does not know (files written by later versions)."""

    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> dict[str, Any]:
        """The dict that is written (json.dumps of it is the file's or the wire's bytes)."""
        return self.model_dump()


# --- per-sequence metadata of a group --------------------------------------------------------


class DecisionRecord(Record):
    """One answer of an episode, scored against Q* (samples.jsonl `decisions`)."""

    state: list[int]  # [player_sum, dealer_card, usable_ace as 0/1]
    natural: bool
    action: Action | None  # None: the answer was not a valid call
    optimal: Action
    regret: float | None  # Q*(s, optimal) - Q*(s, action); None when invalid
    parse_error: str | None
    text: str

    @property
    def observation(self) -> Observation:
        return Observation(self.state[0], self.state[1], bool(self.state[2]))

    @property
    def action_id(self) -> int | None:
        """The action as the game numbers it (HIT, STICK); None for an invalid answer."""
        return None if self.action is None else HIT if self.action == "hit" else STICK


class EpisodeRecord(Record):
    """A whole episode: what travels with a whole-episode group, one per sequence."""

    seed: int
    index: int
    status: Status
    outcome: Outcome | None
    reward: float | None  # the game's reward, when the game finished
    score: float | None  # what training sees; None for a failed episode
    scores: dict[str, float]  # every scoring mode
    start_value: float | None  # V*(first state)
    invalid_reason: str | None
    retries: int
    error: str | None
    actions: list[Action | None]
    optimal_actions: list[Action]
    # summed over valid decisions; an episode with none has the integer 0, as always written
    regret: int | float
    player_hand: list[int]
    dealer_hand: list[int]

    @property
    def choices(self) -> list[tuple[str | None, str]]:
        """(action taken, optimal action) of each answer; None where the answer was invalid."""
        return list(zip(self.actions, self.optimal_actions))


class StepRecord(Record):
    """One answer of a step group: the decision it made in a shared state, scored by Q*."""

    seed: int
    decision: int  # which decision of the canonical episode
    index: int
    state: list[int]
    natural: bool
    action: Action | None
    optimal: Action
    q: dict[str, float]  # {"stick": Q*(s, stick), "hit": Q*(s, hit)}
    invalid_reason: str | None
    score: float
    forced: bool  # a counterfactual call appended to the group, not sampled
    p_call: dict[str, float] | None = None  # counterfactual groups: on the first record only
    p_valid: float | None = None  # counterfactual groups: P(one of the two calls, exactly); first record only
    # step-rollouts groups: the credit's own action values, {"stick", "hit"} mean rewards over
    # `rollouts` rollouts each; first record only (`q` keeps Q*, for the record, never the credit)
    q_estimate: dict[str, float] | None = None
    rollouts: int | None = None
    # the states of the canonical episode's earlier decisions (a decision after a hit); first record only
    history: list[list[int]] | None = None

    @property
    def choices(self) -> list[tuple[str | None, str]]:
        return [(self.action, self.optimal)]

    @model_serializer(mode="wrap")
    def _without_absent_p_call(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("p_call", "p_valid", "q_estimate", "rollouts", "history"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


SequenceRecord = EpisodeRecord | StepRecord
GROUP_BY_STEP = "step"  # generation_params["group_by"] of step groups

# Per-token lists come from our own trajectories, and each is thousands of numbers: checking
# every one would cost more than building the group. Groups from anyone else are checked, number
# by number, by the API's models (api/models.py), the authority on the wire.
_PerToken = SkipValidation[list[list[int]]]
_PerTokenFloat = SkipValidation[list[list[float]]]


class ScoredDataGroup(Record):
    """One group as we emit it: Atropos' ScoredDataGroup plus our `episodes` metadata.

    `advantages` (per-token, with --token-advantages) is left out of the JSON when absent,
    as Atropos' own environments do.
    """

    tokens: _PerToken
    masks: _PerToken
    inference_logprobs: _PerTokenFloat
    scores: list[float]
    messages: list[list[dict[str, str]]]
    generation_params: dict[str, Any]
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    episodes: list[EpisodeRecord] | list[StepRecord]
    advantages: _PerTokenFloat | None = None

    def to_json(self) -> dict[str, Any]:
        """Shallow: the token, mask and logprob lists are handed to the encoder as they are, not
        copied (a deep dump of them costs more than writing them)."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        out["episodes"] = [r.to_json() for r in self.episodes]
        if self.advantages is None:
            del out["advantages"]
        return out

    @property
    def by_step(self) -> bool:
        return self.generation_params.get("group_by") == GROUP_BY_STEP

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ScoredDataGroup":
        """Read a group back (a groups.jsonl line, a batch from the API), its metadata by its kind."""
        return cls.model_validate({**data, "episodes": sequence_records(data)})


def sequence_records(group: Mapping[str, Any]) -> list[EpisodeRecord] | list[StepRecord] | None:
    """The per-sequence metadata of a group read back, typed by the kind of group it says it is;
    None for a group without any (one another environment posted)."""
    raw = group.get("episodes")
    if not raw:
        return None
    kind = StepRecord if (group.get("generation_params") or {}).get("group_by") == GROUP_BY_STEP else EpisodeRecord
    return [r if isinstance(r, kind) else kind.model_validate(r) for r in raw]


def records_or_none(group: Mapping[str, Any]) -> list[SequenceRecord | None]:
    """One record per sequence; None for each sequence of a group that carries none of ours
    (another environment posted it, with no `episodes` or with its own kind)."""
    try:
        return sequence_records(group) or [None for _ in group["scores"]]
    except ValueError:  # pydantic's ValidationError: episodes of another kind
        return [None for _ in group["scores"]]


def decision_record(group: Mapping[str, Any]) -> StepRecord | None:
    """The decision a step group is about (its first record), or None for any other group."""
    first = records_or_none(group)[0] if group.get("scores") else None
    return first if isinstance(first, StepRecord) else None


# --- samples.jsonl ---------------------------------------------------------------------------


class SampleRow(EpisodeRecord):
    """One evaluated episode (a samples.jsonl line): its metadata, its decisions, its messages."""

    decisions: list[DecisionRecord]
    messages: list[dict[str, str]]


# --- metrics.json ----------------------------------------------------------------------------


class RateCI(Record):
    """A rate with its Wilson 95% interval; all None when nothing was counted."""

    rate: float | None
    ci95_low: float | None
    ci95_high: float | None


class MeanCI(Record):
    """A mean with its normal 95% interval (None below the minimum count: `too_few`)."""

    mean: float | None
    ci95_low: float | None
    ci95_high: float | None
    stderr: float | None
    n: int
    too_few: bool


class ReasonCount(Record):
    count: int
    rate: float


class SeedRange(Record):
    first: int
    count: int


class Reference(Record):
    """A reference policy's exact value and outcome odds under the run's rules."""

    value: float
    win: float
    draw: float
    loss: float


# Written only by the jobs that set them (`evaluate` times the run; `--grid` adds the exact grid).
_OPTIONAL_METRICS = ("seconds", "episodes_per_second", "grid")


class Metrics(Record):
    """An evaluation's metrics (metrics.json; also each evaluation of `train` and `serve`)."""

    policy: dict[str, Any]  # the policy's generation parameters
    rules: Rules
    seeds: SeedRange
    episodes: int
    episodes_played: int
    episodes_failed: int
    failure_examples: list[str | None]
    win: RateCI
    draw: RateCI
    loss: RateCI
    invalid: RateCI
    invalid_by_reason: dict[str, ReasonCount]
    mean_reward: MeanCI
    mean_expected_score: MeanCI
    mean_game_reward: MeanCI
    decisions: int
    valid_decisions: int
    decision_accuracy: RateCI
    decision_accuracy_valid: RateCI
    mean_regret: MeanCI
    reference: dict[str, Reference]
    optimal_value: float
    invalid_score: float
    # training's scoring; runs evaluated before these were recorded read back as None ("unrecorded")
    scoring: str | None = None
    format_bonus: float | None = None
    seconds: float | None = None
    episodes_per_second: float | None = None
    grid: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _only_what_was_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for name in _OPTIONAL_METRICS:
            if name not in self.model_fields_set:
                out.pop(name, None)
        return out
