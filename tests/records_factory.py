"""Complete records with neutral values, for tests of the readers (report, compare, viewer) that
set only the fields they are about."""

from __future__ import annotations

from typing import Any, Sequence

from blackjack_rl.game.table import Rules
from blackjack_rl.contract.records import (
    DecisionRecord,
    EpisodeRecord,
    MeanCI,
    Metrics,
    RateCI,
    Reference,
    SampleRow,
    ScoredDataGroup,
    SeedRange,
)


def decision(s: int, d: int, ace: int, action: str | None, optimal: str, regret: float = 0.0,
             text: str = "") -> DecisionRecord:
    return DecisionRecord(state=[s, d, ace], natural=False, action=action, optimal=optimal,
                          regret=None if action is None else regret,
                          parse_error=None if action else "no call", text=text)


def _episode_fields(seed: int, status: str, decisions: Sequence[DecisionRecord]) -> dict[str, Any]:
    return dict(
        seed=seed, index=0, status=status, outcome=None, reward=None, score=-1.0,
        scores={"outcome": -1.0, "expected": -1.0}, start_value=0.0, invalid_reason=None, retries=0, error=None,
        actions=[d.action for d in decisions], optimal_actions=[d.optimal for d in decisions],
        regret=sum(d.regret for d in decisions if d.regret is not None), player_hand=[], dealer_hand=[],
    )


def episode_record(seed: int, status: str = "finished", **fields: Any) -> EpisodeRecord:
    return EpisodeRecord(**{**_episode_fields(seed, status, []), **fields})


def sample_row(seed: int, status: str = "finished", decisions: Sequence[DecisionRecord] = (),
               **fields: Any) -> SampleRow:
    base = {**_episode_fields(seed, status, decisions), "decisions": list(decisions), "messages": []}
    return SampleRow(**{**base, **fields})


def scored_group(tokens: list[list[int]], episodes: list[EpisodeRecord], **fields: Any) -> ScoredDataGroup:
    """Every sequence trained, logprobs of 1.0, scores 0, no messages, unless given."""
    base = dict(tokens=tokens, masks=[list(t) for t in tokens], inference_logprobs=[[1.0] * len(t) for t in tokens],
                scores=[0.0] * len(tokens), messages=[[] for _ in tokens], generation_params={}, episodes=episodes)
    return ScoredDataGroup(**{**base, **fields})


def metrics(**fields: Any) -> Metrics:
    rate = RateCI(rate=None, ci95_low=None, ci95_high=None)
    mean = MeanCI(mean=None, ci95_low=None, ci95_high=None, stderr=None, n=0, too_few=True)
    ref = Reference(value=0.0, win=0.0, draw=0.0, loss=0.0)
    base = dict(
        policy={"policy": "test"}, rules=Rules(), seeds=SeedRange(first=0, count=0), episodes=0,
        episodes_played=0, episodes_failed=0, failure_examples=[], win=rate, draw=rate, loss=rate, invalid=rate,
        invalid_by_reason={}, mean_reward=mean, mean_expected_score=mean, mean_game_reward=mean, decisions=0,
        valid_decisions=0, decision_accuracy=rate, decision_accuracy_valid=rate, mean_regret=mean,
        reference={"optimal": ref, "always_stick": ref, "random": ref}, optimal_value=0.0, invalid_score=-1.0,
        scoring="outcome", format_bonus=0.0,
    )
    return Metrics(**{**base, **fields})
