"""The typed records: what is written reads back as the same record, in the same bytes, and a
group we emit is one the trajectory API accepts."""

import asyncio
import gzip
import json

import pydantic_core
import pytest

from helpers import deal_groups
from blackjack_rl.api.client import encode_groups
from blackjack_rl.api.ingest import IngestContext, prepare_groups
from blackjack_rl.api.models import INTEGERS_SEEN, ScoredGroup
from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import EpisodeSettings
from blackjack_rl.measure.evaluation import compute_metrics
from blackjack_rl.rollout.runner import run_evaluation
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import Reply
from blackjack_rl.policies.bots import OptimalBot, RandomBot
from blackjack_rl.contract.records import (
    EpisodeRecord,
    Metrics,
    SampleRow,
    ScoredDataGroup,
    Status,
    StepRecord,
    Truncation,
    sequence_records,
)
from blackjack_rl.train.groups import read_group
from blackjack_rl.train.metrics import batch_metrics


class SometimesInvalid(RandomBot):
    """Random play, with every third answer not a call: invalid episodes and records too."""

    async def respond(self, turn):
        if turn.seed % 3 == 0:
            return Reply(text="no idea")
        return await super().respond(turn)


def _groups(player, group_by, token_advantages=False, seeds=range(6)):
    config = GroupConfig(group_size=4, credit=f"{group_by}-tokens" if token_advantages else group_by)
    results = [r for s in seeds for r in deal_groups(player, s, config)]
    return [r.group for r in results if r.group is not None]


def _line(record) -> str:
    return json.dumps(record.to_json(), separators=(",", ":"))


@pytest.mark.parametrize("group_by", ["episode", "step"])
@pytest.mark.parametrize("token_advantages", [False, True])
def test_a_group_written_reads_back_as_the_same_record_and_bytes(vocab_chat, solution, group_by, token_advantages):
    player = Player(SometimesInvalid(), vocab_chat, solution, EpisodeSettings(format_bonus=0.25))
    groups = _groups(player, group_by, token_advantages)
    assert groups
    kind = StepRecord if group_by == "step" else EpisodeRecord
    statuses = set()
    for group in groups:
        line = _line(group)
        data = json.loads(line)
        assert ("advantages" in data) == token_advantages  # absent, not null, without per-token credit
        back = ScoredDataGroup.from_json(data)
        assert back == group and _line(back) == line
        assert all(type(r) is kind for r in back.episodes)  # the kind the group says it is
        assert back.by_step == (group_by == "step")
        statuses |= {r.status for r in back.episodes if isinstance(r, EpisodeRecord)}
    if group_by == "episode":
        assert {Status.FINISHED, Status.INVALID} <= statuses


def test_metadata_is_typed_by_what_the_group_says_it_is(vocab_chat, solution):
    """A step record read as a whole episode would fail: the group's `group_by` decides, not the keys."""
    player = Player(RandomBot(), vocab_chat, solution)
    step = _groups(player, "step", seeds=[3])[0].to_json()
    assert all(isinstance(r, StepRecord) for r in sequence_records(step))
    mislabelled = {**step, "generation_params": {k: v for k, v in step["generation_params"].items() if k != "group_by"}}
    with pytest.raises(pydantic_core.ValidationError):
        sequence_records(mislabelled)
    assert sequence_records({"scores": [1.0], "tokens": [[1]]}) is None  # another environment's group


def test_emitted_groups_pass_the_api_validation_unchanged(vocab_chat, solution):
    player = Player(SometimesInvalid(), vocab_chat, solution)
    groups = [g for by in ("episode", "step") for g in _groups(player, by, token_advantages=True, seeds=range(3))]
    ctx = IngestContext(batch_size=8, max_token_len=4096)
    for group in groups:
        data = group.to_json()
        context: dict[str, bool] = {}
        model = ScoredGroup.model_validate(data, context=context)
        assert not context.get(INTEGERS_SEEN)  # floats are floats: the API stores the group as sent
        assert model.tokens == group.tokens and model.advantages == group.advantages
        assert model.model_extra["episodes"] == json.loads(json.dumps(data["episodes"]))  # kept for the trainer
    body = encode_groups([g.to_json() for g in groups])
    prepared = prepare_groups(body, "gzip", ctx, as_list=True, max_bytes=10**8)
    assert [p.n_seq for p in prepared] == [len(g.tokens) for g in groups]
    # on the wire the enums are their strings: the body is what the plain dicts would give
    plain = [json.loads(_line(g)) for g in groups]
    assert gzip.decompress(body) == pydantic_core.to_json(plain)


def test_trainer_metrics_read_both_kinds_of_group_from_their_json(vocab_chat, solution):
    player = Player(OptimalBot(solution), vocab_chat, solution)
    for by in ("episode", "step"):
        m = batch_metrics([read_group(g.to_json()) for g in _groups(player, by, seeds=range(4))])
        assert m["decision_accuracy"] == 1.0 and m["valid_call_rate"] == 1.0
        assert (m["win_rate"] is None) == (by == "step")  # step groups score decisions, not games
    foreign = batch_metrics([read_group({"tokens": [[1], [2]], "masks": [[1], [2]], "scores": [1.0, 0.0],
                                         "episodes": [{"x": 1}, {"x": 2}]})])
    assert foreign["sequences"] == 2 and foreign["decisions"] == 0


def test_samples_rows_and_metrics_read_back_as_written(vocab_chat, solution):
    player = Player(SometimesInvalid(), vocab_chat, solution, EpisodeSettings(max_turns=1))
    episodes = asyncio.run(run_evaluation(player, 40, 4))
    rows = [ep.sample_row() for ep in episodes]
    assert {Status.FINISHED, Status.INVALID, Status.TRUNCATED} <= {r.status for r in rows}
    assert Truncation.TURN_LIMIT in {r.invalid_reason for r in rows}
    for row in rows:
        line = json.dumps(row.to_json())
        back = SampleRow.model_validate(json.loads(line))
        assert back == row and json.dumps(back.to_json()) == line
        assert json.loads(line)["status"] in {"finished", "invalid", "truncated"}  # the enum is its string
    metrics = compute_metrics(episodes, player)
    text = json.dumps(metrics.to_json(), indent=2, allow_nan=False)
    assert "seconds" not in json.loads(text)  # written only by the jobs that time the run
    metrics.seconds, metrics.episodes_per_second = 1.5, None
    text = json.dumps(metrics.to_json(), indent=2, allow_nan=False)
    back = Metrics.model_validate_json(text)
    assert back == metrics and json.dumps(back.to_json(), indent=2, allow_nan=False) == text
    assert json.loads(text)["episodes_per_second"] is None  # set to None is written as null
    assert list(json.loads(text))[:3] == ["policy", "rules", "seeds"]  # keys in the order always written
